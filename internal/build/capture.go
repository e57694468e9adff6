package build

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/template"
)

// capture writes what a RUN step changed, the overlay's upper directory of
// its sandbox, as an OCI layer tar at out: overlay whiteouts (0:0 character
// devices) become .wh. entries, opaque directories .wh..wh..opq, owners are
// the sandbox's (host id - idBase), and cage's own files in the sandbox are
// left out. The sandbox is hostile: everything is read through an os.Root
// of the upper directory, so a symlink it plants never leads the host out.
func capture(upper string, idBase int, out string) (entries int, err error) {
	root, err := os.OpenRoot(upper)
	if err != nil {
		return 0, err
	}
	defer root.Close()
	f, err := os.OpenFile(out, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	tw := tar.NewWriter(f)
	c := &capturer{root: root, tw: tw, base: idBase, links: map[[2]uint64]string{}}
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		if skipped(p) {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		return c.entry(p)
	})
	if err != nil {
		return 0, fmt.Errorf("capture the step's changes: %w", err)
	}
	if err := tw.Close(); err != nil {
		return 0, err
	}
	return c.n, nil
}

func skipped(p string) bool {
	for _, a := range template.BuildArtifacts {
		if p == a || strings.HasPrefix(p, a+"/") {
			return true
		}
	}
	return false
}

type capturer struct {
	root  *os.Root
	tw    *tar.Writer
	base  int
	links map[[2]uint64]string // dev, inode -> first name
	n     int
}

func (c *capturer) id(host uint32, p string) (int, error) {
	id := int(host) - c.base
	if c.base == 0 {
		id = int(host)
	}
	if id < 0 || id > 65535 {
		return 0, fmt.Errorf("%s: owner %d is outside the sandbox's ids", p, host)
	}
	return id, nil
}

func (c *capturer) entry(p string) error {
	fi, err := c.root.Lstat(p)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("%s: no stat", p)
	}
	mode := fi.Mode()
	// A whiteout: the file is deleted in this layer.
	if mode&fs.ModeCharDevice != 0 && st.Rdev == 0 {
		dir, name := path.Split(p)
		c.n++
		return c.tw.WriteHeader(&tar.Header{Name: dir + ".wh." + name, Typeflag: tar.TypeReg, Mode: 0o644, ModTime: fi.ModTime(), Format: tar.FormatPAX})
	}
	if mode&(fs.ModeDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
		return nil // not carried in layers
	}
	uid, err := c.id(st.Uid, p)
	if err != nil {
		return err
	}
	gid, err := c.id(st.Gid, p)
	if err != nil {
		return err
	}
	h := &tar.Header{Name: p, Mode: int64(st.Mode & 0o7777), Uid: uid, Gid: gid, ModTime: fi.ModTime(), Format: tar.FormatPAX}
	switch {
	case mode.IsDir():
		h.Typeflag, h.Name = tar.TypeDir, p+"/"
		opaque, xattrs, err := c.dirAttrs(p)
		if err != nil {
			return err
		}
		setXattrs(h, xattrs)
		if err := c.write(h, nil); err != nil {
			return err
		}
		if opaque {
			return c.write(&tar.Header{Name: p + "/.wh..wh..opq", Typeflag: tar.TypeReg, Mode: 0o644, ModTime: fi.ModTime(), Format: tar.FormatPAX}, nil)
		}
		return nil
	case mode&fs.ModeSymlink != 0:
		target, err := c.root.Readlink(p)
		if err != nil {
			return err
		}
		h.Typeflag, h.Linkname = tar.TypeSymlink, target
		return c.write(h, nil)
	case mode.IsRegular():
		key := [2]uint64{uint64(st.Dev), st.Ino}
		if first, ok := c.links[key]; ok && st.Nlink > 1 {
			h.Typeflag, h.Linkname = tar.TypeLink, first
			return c.write(h, nil)
		}
		c.links[key] = p
		file, err := c.root.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer file.Close()
		setXattrs(h, userXattrs(int(file.Fd())))
		h.Typeflag, h.Size = tar.TypeReg, fi.Size()
		return c.write(h, io.LimitReader(file, fi.Size()))
	}
	return nil
}

func (c *capturer) write(h *tar.Header, body io.Reader) error {
	c.n++
	if err := c.tw.WriteHeader(h); err != nil {
		return err
	}
	if body != nil {
		n, err := io.Copy(c.tw, body)
		if err != nil {
			return err
		}
		if n != h.Size {
			return fmt.Errorf("%s changed while it was read", h.Name)
		}
	}
	return nil
}

// dirAttrs reads a directory's overlay opaque mark and user.* xattrs.
func (c *capturer) dirAttrs(p string) (opaque bool, xattrs map[string]string, err error) {
	d, err := c.root.Open(p)
	if err != nil {
		return false, nil, err
	}
	defer d.Close()
	buf := make([]byte, 8)
	n, err := unix.Fgetxattr(int(d.Fd()), "trusted.overlay.opaque", buf)
	if err == nil && n == 1 && buf[0] == 'y' {
		opaque = true
	} else if err != nil && !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.ENOTSUP) {
		return false, nil, fmt.Errorf("%s: %w", p, err)
	}
	return opaque, userXattrs(int(d.Fd())), nil
}

// userXattrs are a file's user.* extended attributes (the only ones a
// layer carries).
func userXattrs(fd int) map[string]string {
	buf := make([]byte, 4096)
	n, err := unix.Flistxattr(fd, buf)
	if err != nil || n == 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "user.") || strings.HasPrefix(name, "user.overlay.") {
			continue
		}
		val := make([]byte, 4096)
		if m, err := unix.Fgetxattr(fd, name, val); err == nil {
			out[name] = string(val[:m])
		}
	}
	return out
}

func setXattrs(h *tar.Header, x map[string]string) {
	if len(x) == 0 {
		return
	}
	h.PAXRecords = map[string]string{}
	for k, v := range x {
		h.PAXRecords["SCHILY.xattr."+k] = v
	}
}
