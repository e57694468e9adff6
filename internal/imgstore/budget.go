package imgstore

import (
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"io"

	"github.com/klauspost/compress/zstd"
)

// budget bounds what one import reads (decompression bombs) and makes: the
// uncompressed bytes of its layer streams, the bytes of the files it writes
// (a sparse file at its full size, holes included, since holes cost nothing
// to compress), and the entries it makes (directories made for entries whose
// parents the archive did not list included).
type budget struct {
	maxBytes int64
	maxFiles int
	read     int64 // uncompressed bytes read, tar headers included
	written  int64 // bytes of regular files as written out
	files    int
	walked   int // names resolved to open entries' directories
}

// maxWalk bounds the names an import resolves to open the directories its
// entries go in, each name one step down (openat and the checks around it,
// some 10 to 50 µs of the host's time): entries come grouped by directory,
// so real layers pay about one per directory. A small archive whose entries
// alternate between two chains of thousands of directories makes the host
// go down a whole chain for each entry: a 33 KB gzipped archive of 2,000
// such entries took 107 s, and the 2,000,000 an import may hold would have
// taken more than a day. The largest import allowed (2,000,000 files some 8
// deep), even if each of its entries were resolved from the root, stays
// inside; past it, some minutes of the host's time.
const maxWalk = 16 << 20

// walk charges the resolution of a path of n names.
func (b *budget) walk(n int) error {
	b.walked += n
	if b.walked > maxWalk {
		return invalidf("image's entries alternate between directories too deep to unpack (more than %d names to resolve)", maxWalk)
	}
	return nil
}

func newBudget(o Options) *budget {
	return &budget{maxBytes: o.maxBytes(), maxFiles: o.maxFiles()}
}

func (b *budget) tooBig() error {
	return invalidf("image exceeds %d bytes uncompressed", b.maxBytes)
}

func (b *budget) addFile() error {
	b.files++
	if b.files > b.maxFiles {
		return invalidf("image exceeds %d files", b.maxFiles)
	}
	return nil
}

// write charges n bytes of file contents.
func (b *budget) write(n int64) error {
	if n < 0 || n > b.maxBytes-b.written {
		return b.tooBig()
	}
	b.written += n
	return nil
}

// countingReader counts a layer's uncompressed stream against the budget,
// stops when ctx is done, and keeps the first error of the stream so that a
// failed read is not mistaken for a malformed tar.
type countingReader struct {
	ctx context.Context
	r   io.Reader
	b   *budget
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	if err := c.ctx.Err(); err != nil {
		c.err = err
		return 0, err
	}
	// Read at most one byte past the bound: enough to know it was passed.
	if left := c.b.maxBytes - c.b.read + 1; int64(len(p)) > left {
		p = p[:left]
	}
	n, err := c.r.Read(p)
	c.b.read += int64(n)
	if c.b.read > c.b.maxBytes {
		c.err = c.b.tooBig()
		return n, c.err
	}
	if err != nil && err != io.EOF {
		c.err = streamError(err)
		return n, c.err
	}
	return n, err
}

// streamError marks corrupt compressed data as an invalid image; other
// errors (network, disk, context) stay what they are.
func streamError(err error) error {
	var corrupt flate.CorruptInputError
	if errors.Is(err, gzip.ErrHeader) || errors.Is(err, gzip.ErrChecksum) ||
		errors.As(err, &corrupt) || errors.Is(err, io.ErrUnexpectedEOF) || zstdCorrupt(err) {
		return invalidf("corrupt compressed layer: %v", err)
	}
	return err
}

// tarError is an error of the tar reader, told apart from errors of the
// filesystem while an entry is written.
type tarError struct{ err error }

func (e *tarError) Error() string { return e.err.Error() }
func (e *tarError) Unwrap() error { return e.err }

// zstdCorrupt tells the zstd decoder's errors about its input.
func zstdCorrupt(err error) bool {
	for _, e := range []error{zstd.ErrWindowSizeExceeded, zstd.ErrWindowSizeTooSmall, zstd.ErrMagicMismatch,
		zstd.ErrReservedBlockType, zstd.ErrCompressedSizeTooBig, zstd.ErrBlockTooSmall, zstd.ErrUnexpectedBlockSize,
		zstd.ErrFrameSizeExceeded, zstd.ErrFrameSizeMismatch, zstd.ErrCRCMismatch, zstd.ErrUnknownDictionary} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
