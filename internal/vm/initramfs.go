package vm

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cagehq/cage/internal/vm/boot"
)

// File types of a cpio entry's mode (the values of stat's S_IF*).
const (
	cpioDir  = 0o040000
	cpioReg  = 0o100000
	cpioChar = 0o020000
)

// WriteInitramfs writes the guest's initramfs to w: an uncompressed newc
// cpio with the file at initPath as /init (mode 0755), the named modules of
// k and all they depend on under /lib/modules/VERSION, and boot.ModulesOrder.
// Modules built into k are left out. Compressed modules are copied as they
// are when the kernel decompresses modules itself, and refused otherwise.
// Owners are root and times zero, so the same inputs give the same bytes.
func WriteInitramfs(w io.Writer, k *Kernel, initPath string, modules []string) error {
	paths, _, err := k.ResolveModules(modules)
	if err != nil {
		return err
	}
	for _, p := range paths {
		if c := boot.Compression(p); c != "" {
			ok, err := k.canLoadCompressed(c)
			if err != nil {
				return fmt.Errorf("read kernel %s's configuration: %w", k.Version, err)
			}
			if !ok {
				return fmt.Errorf("module %s is compressed (%s) and kernel %s cannot load it compressed", p, c, k.Version)
			}
		}
	}
	fi, err := os.Stat(initPath)
	if err != nil {
		return fmt.Errorf("init for the initramfs: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("init for the initramfs: %s is not a regular file", initPath)
	}

	modRoot := path.Join("lib/modules", k.Version)
	dirs := []string{"dev", "proc", "sys"}
	var order strings.Builder
	for _, p := range paths {
		for d := path.Dir(path.Join(modRoot, p)); d != "."; d = path.Dir(d) {
			dirs = append(dirs, d)
		}
		fmt.Fprintf(&order, "/%s/%s\n", modRoot, p)
	}
	// Sorted, a directory comes before what it holds.
	slices.Sort(dirs)
	dirs = slices.Compact(dirs)

	cw := &cpioWriter{w: bufio.NewWriterSize(w, 1<<16)}
	for _, d := range dirs {
		cw.header(d, cpioDir|0o755, 0, 0, 0)
	}
	// The kernel opens /dev/console for init's standard streams before
	// /init runs; most kernels bring a built-in /dev/console, this one does
	// not depend on that.
	cw.header("dev/console", cpioChar|0o600, 0, 5, 1)
	if err := cw.file("init", cpioReg|0o755, initPath, fi.Size()); err != nil {
		return err
	}
	for _, p := range paths {
		src := filepath.Join(k.Modules, filepath.FromSlash(p))
		mfi, err := os.Stat(src)
		if err != nil {
			return fmt.Errorf("module for the initramfs: %w", err)
		}
		if err := cw.file(path.Join(modRoot, p), cpioReg|0o644, src, mfi.Size()); err != nil {
			return err
		}
	}
	cw.data(strings.TrimPrefix(boot.ModulesOrder, "/"), cpioReg|0o644, []byte(order.String()))
	cw.header("TRAILER!!!", 0, 0, 0, 0)
	if cw.err != nil {
		return fmt.Errorf("write initramfs: %w", cw.err)
	}
	if err := cw.w.Flush(); err != nil {
		return fmt.Errorf("write initramfs: %w", err)
	}
	return nil
}

// cpioWriter writes the "newc" format the kernel unpacks: a 110-byte ASCII
// header, the name with its NUL, and the data, each padded to 4 bytes. The
// first error sticks and ends the writing.
type cpioWriter struct {
	w   *bufio.Writer
	ino uint32
	n   int64 // bytes written, for the padding
	err error
}

func (c *cpioWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	var n int
	n, c.err = c.w.Write(b)
	c.n += int64(n)
}

func (c *cpioWriter) pad() {
	if r := c.n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// header writes an entry's header and name; its data, if any, follows.
func (c *cpioWriter) header(name string, mode uint32, size int64, rdevMajor, rdevMinor uint32) {
	if c.err == nil && size > 0xffffffff {
		c.err = fmt.Errorf("%s is too large for a cpio archive", name)
	}
	var ino, nlink uint32
	if name != "TRAILER!!!" {
		c.ino++
		ino, nlink = c.ino, 1
		if mode&cpioDir == cpioDir {
			nlink = 2
		}
	}
	// Fields: magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor,
	// devminor, rdevmajor, rdevminor, namesize (with the NUL), check.
	h := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, mode, 0, 0, nlink, 0, uint32(size), 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	c.write([]byte(h))
	c.write(append([]byte(name), 0))
	c.pad()
}

func (c *cpioWriter) data(name string, mode uint32, b []byte) {
	c.header(name, mode, int64(len(b)), 0, 0)
	c.write(b)
	c.pad()
}

// file copies the file at src, which must still be size bytes long.
func (c *cpioWriter) file(name string, mode uint32, src string, size int64) error {
	f, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	defer f.Close()
	c.header(name, mode, size, 0, 0)
	if c.err != nil {
		return nil
	}
	n, err := io.Copy(c.w, io.LimitReader(f, size))
	c.n += n
	if err != nil {
		return fmt.Errorf("initramfs: copy %s: %w", src, err)
	}
	if n != size {
		return fmt.Errorf("initramfs: %s changed while being copied", src)
	}
	c.pad()
	return nil
}
