package build

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strconv"
	"strings"
	"syscall"

	"github.com/cagehq/cage/internal/imgstore"
)

// copy makes the layer of a COPY or ADD of files from the build context.
// Sources are resolved inside the context (os.Root: no "..", no symlink
// out of it). ADD takes local files only and does not unpack archives.
func (b *Builder) copy(ctx context.Context, held *imgstore.Held, st *state, in Instruction, args string) (string, error) {
	if b.Context == "" { // never the daemon's working directory
		return "", failf("%s needs a build context, and this build has none", in.Cmd)
	}
	for k := range in.Flags {
		if k != "chown" {
			return "", failf("%s --%s is not supported", in.Cmd, k)
		}
	}
	uid, gid, err := chown(in.Flags["chown"])
	if err != nil {
		return "", failf("%v", err)
	}
	list := in.Exec
	if list == nil {
		if list, err = words(args); err != nil {
			return "", failf("%v", err)
		}
	}
	if len(list) < 2 {
		return "", failf("%s needs a source and a destination", in.Cmd)
	}
	srcs, dest := list[:len(list)-1], list[len(list)-1]
	for _, s := range srcs {
		if strings.Contains(s, "://") {
			return "", failf("%s %s: only files of the build context can be added", in.Cmd, s)
		}
	}
	if !path.IsAbs(dest) {
		dest = path.Join("/", st.cfg.WorkingDir, dest)
	}
	root, err := os.OpenRoot(b.Context)
	if err != nil {
		return "", failf("build context: %v", err)
	}
	defer root.Close()
	var files []copied
	for _, s := range srcs {
		got, err := collect(root, s, dest, len(srcs) > 1 || strings.HasSuffix(list[len(list)-1], "/"))
		if err != nil {
			return "", failf("%v", err)
		}
		files = append(files, got...)
	}
	h := sha256.New()
	for _, f := range files {
		f.describe(h)
		if f.mode.IsRegular() {
			r, err := openRegular(root, f.src)
			if err != nil {
				return "", err
			}
			_, err = io.Copy(h, ctxReader{ctx, r})
			r.Close()
			if err != nil {
				return "", err
			}
		}
	}
	sum := h.Sum(nil)
	key := chain(st.key, "COPY", in.Args, in.Flags["chown"], hex.EncodeToString(sum))
	if b.cached(held, st, key) {
		return "cached", nil
	}
	if testHookBeforeCopy != nil {
		testHookBeforeCopy()
	}
	tarFile, err := b.Host.Templates.Staging()
	if err != nil {
		return "", err
	}
	defer tarFile.Close()
	tw := tar.NewWriter(tarFile)
	// The files are read again to be written: what is written must be
	// what the key was made of, else the layer would be served for
	// another content by every later build (the context's owner, or an
	// editor, changed a file in between).
	h.Reset()
	for _, f := range files {
		f.describe(h)
		if err := writeCopied(ctx, tw, root, f, uid, gid, h); err != nil {
			return "", err
		}
	}
	if !bytes.Equal(h.Sum(nil), sum) {
		return "", failf("the build context changed while %s read it (build again once it is still)", in.Cmd)
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	d, err := b.addLayer(ctx, held, st, tarFile.Name(), key)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("layer %s, %d entries", d[7:19], len(files)), nil
}

func chown(s string) (int, int, error) {
	if s == "" {
		return 0, 0, nil
	}
	u, g, ok := strings.Cut(s, ":")
	uid, err := strconv.Atoi(u)
	if err != nil || uid < 0 || uid > 65535 {
		return 0, 0, fmt.Errorf("--chown=%s: want numeric ids (0-65535)", s)
	}
	gid := uid
	if ok {
		if gid, err = strconv.Atoi(g); err != nil || gid < 0 || gid > 65535 {
			return 0, 0, fmt.Errorf("--chown=%s: want numeric ids (0-65535)", s)
		}
	}
	return uid, gid, nil
}

// copied is one entry a COPY puts in the image.
type copied struct {
	src, dst string
	mode     fs.FileMode
	link     string
}

// describe writes what identifies f, but for a file's bytes, to the
// COPY's key.
func (f copied) describe(h io.Writer) {
	fmt.Fprintf(h, "%s\x00%s\x00%o\x00%s\x00", f.src, f.dst, f.mode, f.link)
}

// testHookBeforeCopy, when set (by tests), runs between a COPY's key and
// the writing of its layer: where the context may change.
var testHookBeforeCopy func()

// collect lists what COPY src dest copies: a file to dest (or into it when
// it is a directory), a directory's contents into dest.
func collect(root *os.Root, src, dest string, destIsDir bool) ([]copied, error) {
	clean := path.Clean("/" + src)[1:]
	if clean == "" {
		clean = "."
	}
	fi, err := root.Lstat(clean)
	if err != nil {
		return nil, fmt.Errorf("%s: not in the build context: %v", src, unwrapPath(err))
	}
	if fi.Mode()&(fs.ModeDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
		return nil, fmt.Errorf("%s: not a file, directory or symbolic link", src)
	}
	if !fi.IsDir() {
		dst := dest
		if destIsDir {
			dst = path.Join(dest, path.Base(clean))
		}
		c := copied{src: clean, dst: dst, mode: fi.Mode()}
		if fi.Mode()&fs.ModeSymlink != 0 {
			if c.link, err = root.Readlink(clean); err != nil {
				return nil, err
			}
		}
		return []copied{c}, nil
	}
	var out []copied
	err = fs.WalkDir(root.FS(), clean, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(p, clean), "/")
		if clean == "." {
			rel = p
			if p == "." {
				rel = ""
			}
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		c := copied{src: p, dst: path.Join(dest, rel), mode: info.Mode()}
		if info.Mode()&fs.ModeSymlink != 0 {
			if c.link, err = root.Readlink(p); err != nil {
				return err
			}
		}
		if info.Mode()&(fs.ModeDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			return nil
		}
		out = append(out, c)
		return nil
	})
	return out, err
}

func unwrapPath(err error) error {
	if pe, ok := err.(*fs.PathError); ok {
		return pe.Err
	}
	return err
}

// writeCopied writes f to tw, and a regular file's bytes also to sum.
func writeCopied(ctx context.Context, tw *tar.Writer, root *os.Root, f copied, uid, gid int, sum io.Writer) error {
	h := &tar.Header{Name: strings.TrimPrefix(f.dst, "/"), Mode: int64(f.mode.Perm()), Uid: uid, Gid: gid, Format: tar.FormatPAX}
	switch {
	case f.mode.IsDir():
		h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		return tw.WriteHeader(h)
	case f.mode&fs.ModeSymlink != 0:
		h.Typeflag, h.Linkname = tar.TypeSymlink, f.link
		return tw.WriteHeader(h)
	}
	r, err := openRegular(root, f.src)
	if err != nil {
		return err
	}
	defer r.Close()
	fi, err := r.Stat()
	if err != nil {
		return err
	}
	h.Typeflag, h.Size, h.ModTime = tar.TypeReg, fi.Size(), fi.ModTime()
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	n, err := io.Copy(tw, io.LimitReader(io.TeeReader(ctxReader{ctx, r}, sum), fi.Size()))
	if err == nil && n != fi.Size() {
		err = fmt.Errorf("%s changed while it was copied", f.src)
	}
	return err
}

// openRegular opens a regular file of the build context, never following
// a link and never waiting (a FIFO put in a file's place since the context
// was listed opens at once, and is refused).
func openRegular(root *os.Root, name string) (*os.File, error) {
	f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		if err == nil {
			err = fmt.Errorf("%s: not a regular file", name)
		}
		return nil, err
	}
	return f, nil
}

// ctxReader stops reading once ctx ends: a COPY of a large context stops
// when its build is cancelled, not when it has read every byte.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
