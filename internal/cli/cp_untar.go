package cli

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/units"
)

// What a copy out of a sandbox may make on the host. A sparse file of a
// terabyte costs its sandbox nothing: the bounds are on bytes as the host
// would hold them (files at their full size, holes included) and as the
// sandbox sends them (the archive, headers included), and on entries.
type cpLimits struct {
	MaxBytes   int64
	MaxEntries int
}

const (
	defaultCpMaxBytes   = 4 << 30
	defaultCpMaxEntries = 1_000_000
	maxCpName           = 4096 // PATH_MAX
)

// limitError says a copy out of a sandbox passed one of its bounds.
type limitError struct{ msg string }

func (e *limitError) Error() string { return e.msg }

func (l cpLimits) tooBig() error {
	return &limitError{fmt.Sprintf("more than %s (--max-bytes)", units.HumanSize(l.MaxBytes))}
}

func (l cpLimits) tooMany() error {
	return &limitError{fmt.Sprintf("more than %d entries (--max-entries)", l.MaxEntries)}
}

// cappedReader fails once more than left bytes have been read.
type cappedReader struct {
	r    io.Reader
	left int64
	err  error // returned once left is passed
}

func (c *cappedReader) Read(p []byte) (int, error) {
	if c.left < 0 {
		return 0, c.err
	}
	if int64(len(p)) > c.left+1 {
		p = p[:c.left+1]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	if c.left < 0 {
		return n, c.err
	}
	return n, err
}

// untarrer writes a hostile tar stream under root, an empty directory made
// for it. Nothing is ever removed or replaced: an entry naming something
// already there (but a directory again) is refused, so a directory once
// checked stays a directory, and the only one remembered is the chain: the
// last directory checked, which with its parents is known to be real. An
// entry under a symlink or a file is refused, a hard link may only name a
// regular file already written, devices and FIFOs are skipped, modes keep
// only their permission bits, and os.Root keeps every path inside root.
type untarrer struct {
	root    *os.Root
	lim     cpLimits
	written int64 // bytes of files, holes included
	entries int   // entries read, and directories made for them
	skipped int
	chain   string
	buf     []byte
}

// untar unpacks r under root within lim.
func untar(root *os.Root, r io.Reader, lim cpLimits) (*untarrer, error) {
	u := &untarrer{root: root, lim: lim, chain: "."}
	tr := tar.NewReader(&cappedReader{r: r, left: lim.MaxBytes, err: lim.tooBig()})
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return u, nil
		}
		if err == nil {
			err = u.count()
		}
		if err == nil {
			err = u.entry(tr, hdr)
		}
		if err != nil {
			return u, err
		}
	}
}

func (u *untarrer) count() error {
	u.entries++
	if u.entries > u.lim.MaxEntries {
		return u.lim.tooMany()
	}
	return nil
}

// cpEntryName makes an entry's name relative to the destination, or
// refuses it.
func cpEntryName(name string) (string, error) {
	if len(name) > maxCpName || strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("refusing an entry of more than %d bytes or with a NUL from the sandbox", maxCpName)
	}
	c := path.Clean(strings.TrimPrefix(name, "./"))
	if path.IsAbs(c) || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("refusing tar entry %q from the sandbox: it leaves the destination", name)
	}
	return c, nil
}

func (u *untarrer) entry(tr *tar.Reader, hdr *tar.Header) error {
	name, err := cpEntryName(hdr.Name)
	if err != nil {
		return err
	}
	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return fmt.Errorf("refusing tar entry %q from the sandbox: the top is not a directory", hdr.Name)
		}
		return nil
	}
	perm := os.FileMode(hdr.Mode).Perm()
	switch hdr.Typeflag {
	case tar.TypeDir:
		return u.dir(name, perm)
	case tar.TypeReg, tar.TypeGNUSparse:
		return u.file(tr, name, hdr.Size, perm)
	case tar.TypeSymlink:
		if err := u.parent(path.Dir(name)); err != nil {
			return err
		}
		return u.made(name, u.root.Symlink(hdr.Linkname, name))
	case tar.TypeLink:
		return u.hardlink(name, hdr.Linkname)
	default:
		u.skipped++ // devices, FIFOs, and types cage does not know
		return nil
	}
}

// made turns an error of making name into one the user can read.
func (u *untarrer) made(name string, err error) error {
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("refusing tar entry %q from the sandbox: it names an entry already copied", name)
	}
	return err
}

// parent makes sure dir is a real directory under root, making what is
// missing (each directory made counts as an entry).
func (u *untarrer) parent(dir string) error {
	if dir == "." || dir == u.chain || strings.HasPrefix(u.chain, dir+"/") {
		return nil
	}
	if err := u.parent(path.Dir(dir)); err != nil {
		return err
	}
	fi, err := u.root.Lstat(dir)
	switch {
	case err == nil && fi.IsDir():
	case err == nil:
		return fmt.Errorf("refusing entries from the sandbox under %q, which is not a directory", dir)
	case errors.Is(err, fs.ErrNotExist):
		if err := u.count(); err != nil {
			return err
		}
		if err := u.root.Mkdir(dir, 0o755); err != nil {
			return err
		}
	default:
		return err
	}
	u.chain = dir
	return nil
}

func (u *untarrer) dir(name string, perm os.FileMode) error {
	if err := u.parent(path.Dir(name)); err != nil {
		return err
	}
	err := u.root.Mkdir(name, perm|0o700)
	if errors.Is(err, fs.ErrExist) {
		if fi, lerr := u.root.Lstat(name); lerr == nil && fi.IsDir() {
			err = nil // a directory again, or one made for an earlier entry
		}
	}
	if err != nil {
		return u.made(name, err)
	}
	u.chain = name
	return nil
}

func (u *untarrer) file(tr *tar.Reader, name string, size int64, perm os.FileMode) error {
	// The full size is charged before anything is written.
	if size < 0 || size > u.lim.MaxBytes-u.written {
		return u.lim.tooBig()
	}
	u.written += size
	if err := u.parent(path.Dir(name)); err != nil {
		return err
	}
	f, err := u.root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return u.made(name, err)
	}
	if u.buf == nil {
		u.buf = make([]byte, 256<<10)
	}
	hw := &imgstore.HoleWriter{F: f}
	_, err = io.CopyBuffer(hw, tr, u.buf)
	if err == nil {
		err = hw.Finish()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

func (u *untarrer) hardlink(name, target string) error {
	t, err := cpEntryName(target)
	if err != nil {
		return err
	}
	if fi, err := u.root.Lstat(t); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("refusing hard link %q from the sandbox: %q is not a file it copied", name, target)
	}
	if err := u.parent(path.Dir(name)); err != nil {
		return err
	}
	return u.made(name, u.root.Link(t, name))
}
