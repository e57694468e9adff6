package build

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/wall"
)

// captureAfter destroys the step's sandbox, then captures its upper
// directory (see capture) at stateDir/rel. The upper directory lives on a
// tmpfs under the sandbox's state directory, which teardown detaches: a
// descriptor opened before keeps the tmpfs, and so the step's files, until
// the capture is done, when no process of the step is left to change them
// under the reader (a FIFO swapped in for a file would block it; a file
// growing without end would never be read to its end).
func captureAfter(ctx context.Context, sb wall.Sandbox, stateDir, rel string, maxBytes int64, out string) (int, error) {
	sd, err := os.Open(stateDir)
	if err != nil {
		return 0, err
	}
	defer sd.Close()
	fd, err := unix.Openat2(int(sd.Fd()), rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return 0, fmt.Errorf("open the step's upper directory: %w", err)
	}
	upper := os.NewFile(uintptr(fd), rel)
	defer upper.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, err
	}
	if err := sb.Destroy(); err != nil {
		return 0, fmt.Errorf("remove the step's sandbox: %w", err)
	}
	root, err := os.OpenRoot(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return 0, err
	}
	defer root.Close()
	return capture(ctx, root, int(st.Uid), maxBytes, out)
}

// Bounds of a capture. The step wrote the tree, and the host pays for
// every entry in proportion to its depth (os.Root resolves a path one
// name at a time) and for every name's bytes (in the tar's headers, and
// a hard-linked file's first name in memory): a chain of thousands of
// nested directories took the host minutes of system time, and long
// names over empty files gigabytes, from a step that used a few inodes.
// Real layers stay far inside them (a node_modules tree of 50,000 files
// averages some 8 names deep).
const (
	maxCaptureName  = 4096      // bytes of one entry's name (as a layer may hold)
	maxCaptureDepth = 256       // names in one entry's path
	maxCaptureWalk  = 8 << 20   // names resolved over every entry
	maxCaptureNames = 256 << 20 // bytes of every entry's name
)

// errCaptureBounds is a step whose changes are past a capture's bounds.
var errCaptureBounds = errors.New("the step's changes are past what a layer may hold")

// capture writes what a RUN step changed, the overlay's upper directory of
// its sandbox (root), as an OCI layer tar at out: overlay whiteouts (0:0
// character devices) become .wh. entries, opaque directories .wh..wh..opq,
// owners are the sandbox's (host id - idBase), and cage's own files in the
// sandbox are left out. The files' bytes, a sparse file's holes included
// (a layer carries them whole), are at most maxBytes: the step's disk,
// which a sparse file of terabytes takes none of. The sandbox wrote
// everything here: it is read
// through an os.Root, so a symlink it planted never leads the host out, and
// every file and directory is opened without following, without blocking
// (a FIFO opens at once) and checked to be what Lstat saw, else refused.
func capture(ctx context.Context, root *os.Root, idBase int, maxBytes int64, out string) (entries int, err error) {
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
	c := &capturer{root: root, tw: tw, base: idBase, links: map[[2]uint64]string{}, left: maxBytes}
	var walked, names int
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		depth := strings.Count(p, "/") + 1
		walked += depth
		names += len(p)
		switch {
		case len(p) > maxCaptureName:
			return fmt.Errorf("%w: a name of %d bytes (at most %d): %.80s...", errCaptureBounds, len(p), maxCaptureName, p)
		case depth > maxCaptureDepth:
			return fmt.Errorf("%w: a path %d directories deep (at most %d): %.80s...", errCaptureBounds, depth, maxCaptureDepth, p)
		case walked > maxCaptureWalk:
			return fmt.Errorf("%w: more than %d names to resolve (files times their depth)", errCaptureBounds, maxCaptureWalk)
		case names > maxCaptureNames:
			return fmt.Errorf("%w: more than %d MiB of file names", errCaptureBounds, maxCaptureNames>>20)
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

// testHookAfterLstat, when set (by tests), runs between an entry's Lstat
// and its opening: where the sandbox could swap the entry.
var testHookAfterLstat func(p string)

// openSame opens p (flags plus no following, no blocking, close-on-exec)
// and checks it is the file st describes.
func (c *capturer) openSame(p string, flags int, st *syscall.Stat_t) (*os.File, error) {
	f, err := c.root.OpenFile(p, flags|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%s changed while it was read: %w", p, err)
	}
	var now syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &now); err != nil {
		f.Close()
		return nil, err
	}
	if now.Dev != st.Dev || now.Ino != st.Ino || now.Mode&syscall.S_IFMT != st.Mode&syscall.S_IFMT {
		f.Close()
		return nil, fmt.Errorf("%s changed while it was read", p)
	}
	return f, nil
}

func skipped(p string) bool {
	for _, a := range inside.BuildArtifacts {
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
	left  int64 // bytes the layer's files may still hold
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
	if testHookAfterLstat != nil {
		testHookAfterLstat(p)
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
		opaque, xattrs, err := c.dirAttrs(p, st)
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
		if st.Nlink > 1 { // only a file with other names needs its first one kept
			c.links[key] = p
		}
		file, err := c.openSame(p, os.O_RDONLY, st)
		if err != nil {
			return err
		}
		defer file.Close()
		if c.left -= fi.Size(); c.left < 0 {
			return fmt.Errorf("%w: its files hold more bytes than the step's disk (a sparse file counts whole, as a layer carries it): %.80s", errCaptureBounds, p)
		}
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
func (c *capturer) dirAttrs(p string, st *syscall.Stat_t) (opaque bool, xattrs map[string]string, err error) {
	d, err := c.openSame(p, os.O_RDONLY|syscall.O_DIRECTORY, st)
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
