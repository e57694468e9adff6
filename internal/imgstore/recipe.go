package imgstore

// A layer's tar cannot be rebuilt byte for byte from its unpacked files by
// writing a fresh tar: header formats, entry order, padding, dropped entries
// (devices, xattrs cage refused) and trailing blocks differ from tool to tool,
// and the diff ID is the sha256 of those exact bytes. So while unpacking, cage
// records every byte of the layer's stream except the contents of regular
// files, which it records as references to the unpacked file
// (path and length). Export replays the recipe, reading contents from the
// layer, and checks the result against the diff ID.
//
// The recipe is gzip-compressed: a magic line, then segments
//
//	'L' uvarint(n) n bytes          literal bytes of the stream
//	'F' uvarint(n) n-byte path uvarint(size)   contents of the unpacked file at path
//	'E'                             end

import (
	"bufio"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

const (
	recipeMagic   = "cage-tarmeta-1\n"
	literalChunk  = 1 << 20 // literal bytes are flushed in segments of at most this
	maxRecipePath = 1 << 16
)

// recipeWriter writes a recipe as the layer is read.
type recipeWriter struct {
	gz  *gzip.Writer
	bw  *bufio.Writer
	lit []byte // literal bytes not yet written
	err error
}

func newRecipeWriter(w io.Writer) *recipeWriter {
	bw := bufio.NewWriterSize(w, 64<<10)
	gz, _ := gzip.NewWriterLevel(bw, gzip.BestSpeed)
	rw := &recipeWriter{gz: gz, bw: bw}
	rw.write([]byte(recipeMagic))
	return rw
}

func (rw *recipeWriter) write(b []byte) {
	if rw.err == nil {
		_, rw.err = rw.gz.Write(b)
	}
}

func (rw *recipeWriter) uvarint(v uint64) {
	var b [binary.MaxVarintLen64]byte
	rw.write(b[:binary.PutUvarint(b[:], v)])
}

// literal records bytes of the stream as they are.
func (rw *recipeWriter) literal(p []byte) {
	for len(p) > 0 {
		n := min(len(p), literalChunk-len(rw.lit))
		rw.lit = append(rw.lit, p[:n]...)
		p = p[n:]
		if len(rw.lit) == literalChunk {
			rw.flushLiteral()
		}
	}
}

func (rw *recipeWriter) flushLiteral() {
	if len(rw.lit) == 0 {
		return
	}
	rw.write([]byte{'L'})
	rw.uvarint(uint64(len(rw.lit)))
	rw.write(rw.lit)
	rw.lit = rw.lit[:0]
}

// file records that the next size bytes of the stream are the contents of
// the unpacked file at name.
func (rw *recipeWriter) file(name string, size int64) {
	rw.flushLiteral()
	rw.write([]byte{'F'})
	rw.uvarint(uint64(len(name)))
	rw.write([]byte(name))
	rw.uvarint(uint64(size))
}

// finish ends the recipe and flushes it to the underlying writer.
func (rw *recipeWriter) finish() error {
	rw.flushLiteral()
	rw.write([]byte{'E'})
	if rw.err == nil {
		rw.err = rw.gz.Close()
	}
	if rw.err == nil {
		rw.err = rw.bw.Flush()
	}
	return rw.err
}

// recorder passes the layer stream to the tar reader and records what it
// reads into the recipe, except while paused (a regular file's contents,
// recorded as a reference instead).
type recorder struct {
	r      io.Reader
	rw     *recipeWriter
	paused bool
}

func (r *recorder) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if n > 0 && !r.paused {
		r.rw.literal(p[:n])
	}
	return n, err
}

// replayRecipe writes the stream a recipe describes to w, taking file
// contents from openFile.
func replayRecipe(recipe io.Reader, w io.Writer, openFile func(name string, size int64) (io.ReadCloser, error)) error {
	gz, err := gzip.NewReader(recipe)
	if err != nil {
		return fmt.Errorf("recipe: %w", err)
	}
	br := bufio.NewReader(gz)
	magic := make([]byte, len(recipeMagic))
	if _, err := io.ReadFull(br, magic); err != nil || string(magic) != recipeMagic {
		return errors.New("recipe: bad header")
	}
	for {
		kind, err := br.ReadByte()
		if err != nil {
			return fmt.Errorf("recipe: %w", err)
		}
		switch kind {
		case 'E':
			return nil
		case 'L':
			n, err := binary.ReadUvarint(br)
			if err != nil || n > literalChunk {
				return errors.New("recipe: bad literal segment")
			}
			if _, err := io.CopyN(w, br, int64(n)); err != nil {
				return fmt.Errorf("recipe: %w", err)
			}
		case 'F':
			if err := replayFile(br, w, openFile); err != nil {
				return err
			}
		default:
			return fmt.Errorf("recipe: bad segment %q", kind)
		}
	}
}

func replayFile(br *bufio.Reader, w io.Writer, openFile func(string, int64) (io.ReadCloser, error)) error {
	n, err := binary.ReadUvarint(br)
	if err != nil || n > maxRecipePath {
		return errors.New("recipe: bad file segment")
	}
	name := make([]byte, n)
	if _, err := io.ReadFull(br, name); err != nil {
		return fmt.Errorf("recipe: %w", err)
	}
	size, err := binary.ReadUvarint(br)
	if err != nil || size > 1<<62 {
		return errors.New("recipe: bad file segment")
	}
	f, err := openFile(string(name), int64(size))
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.CopyN(w, f, int64(size)); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}
