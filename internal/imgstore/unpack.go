package imgstore

// Unpacking one layer of a hostile archive into its own directory, in the
// form overlayfs wants for a lower layer.
//
// Every entry's parent is first made a known, real directory of the layer
// (checked with fstatat without following: a symlink on the way is an
// error, not something to follow), then opened through the layer's os.Root,
// and the entry itself is made with an *at system call on that single
// component. So a symlink the archive planted earlier can never carry a
// write outside the layer, and the os.Root stays the last line of defence
// should that bookkeeping be wrong.
//
// What the unpacker remembers does not grow with the number of entries: one
// directory whose path was checked (the chain: it and its parents are real
// directories of the layer, until something on it is removed), one open
// parent directory and the times to give it back. Each entry costs a bounded
// number of system calls beyond making the directories new on its path, so
// a layer unpacks in time linear in its entries (names are at most 4096
// bytes). A hard link's target is looked up in the layer itself: the layer's
// directory starts empty, so what is there an earlier entry made. A
// directory's times are set when its entry comes, and put back whenever the
// unpacker is done making or removing entries in it.

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

const (
	maxEntryName = 4096 // PATH_MAX: longer names are refused
	maxID        = 65535
)

// layerStats is what unpacking a layer found.
type layerStats struct {
	size    int64 // bytes of regular files
	files   int   // entries made
	skipped int   // devices, FIFOs and other entries not made
	dropped int   // xattrs not kept
}

// unpacker writes one layer's entries under root.
type unpacker struct {
	root   *os.Root
	label  string // "layer 2/3 sha256:…", for messages
	budget *budget
	rec    *recorder

	chain string // a checked directory: it and its parents are real ("." at first)

	parentName  string          // the open parent directory
	parent      *os.File        //
	parentTimes []unix.Timespec // its atime and mtime, put back when it is closed
	buf         []byte          // for copying file contents
	stats       layerStats
}

func newUnpacker(root *os.Root, label string, b *budget, rec *recorder) *unpacker {
	return &unpacker{root: root, label: label, budget: b, rec: rec, chain: "."}
}

// run unpacks every entry of tr.
func (u *unpacker) run(tr *tar.Reader) error {
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			err = &tarError{err}
		} else if err = u.budget.addFile(); err == nil {
			err = u.entry(tr, hdr)
		}
		if err != nil {
			u.closeParent()
			return err
		}
	}
	return u.closeParent()
}

// cleanEntryName makes an entry's name relative to the layer root. Leading
// slashes are dropped (an absolute name lands inside the layer); a name that
// climbs out with ".." is refused.
func cleanEntryName(name string) (string, bool) {
	if len(name) > maxEntryName || strings.ContainsRune(name, 0) {
		return "", false
	}
	c := path.Clean(strings.TrimLeft(name, "/"))
	if c == ".." || strings.HasPrefix(c, "../") {
		return "", false
	}
	return c, true
}

func (u *unpacker) entry(tr *tar.Reader, hdr *tar.Header) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil // tar.Reader applies nothing from it; neither does cage
	}
	if len(hdr.Name) > maxEntryName || strings.ContainsRune(hdr.Name, 0) {
		return invalidf("%s: an entry's name is longer than %d bytes or holds a NUL", u.label, maxEntryName)
	}
	name, ok := cleanEntryName(hdr.Name)
	if !ok {
		return invalidf("%s: entry %q escapes the layer", u.label, hdr.Name)
	}
	if hdr.Uid < 0 || hdr.Uid > maxID || hdr.Gid < 0 || hdr.Gid > maxID {
		return invalidf("%s: entry %q is owned by %d:%d, outside 0-%d", u.label, hdr.Name, hdr.Uid, hdr.Gid, maxID)
	}
	if strings.HasPrefix(path.Base(name), ".wh.") {
		return u.whiteout(name, hdr)
	}
	if name == "." && hdr.Typeflag != tar.TypeDir {
		return invalidf("%s: entry %q names the layer root but is not a directory", u.label, hdr.Name)
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		return u.dir(name, hdr)
	case tar.TypeReg, tar.TypeGNUSparse, tar.TypeCont:
		return u.file(tr, name, hdr)
	case tar.TypeSymlink:
		return u.symlink(name, hdr)
	case tar.TypeLink:
		return u.hardlink(name, hdr)
	default:
		// Devices and FIFOs are not made: a template has no use for them
		// and the sandbox gets its own /dev. Unknown types likewise.
		u.stats.skipped++
		return nil
	}
}

// onChain tells whether dir is the chain or one of its parents.
func onChain(dir, chain string) bool {
	return dir == "." || dir == chain || strings.HasPrefix(chain, dir+"/")
}

// knownDir makes sure dir is a real directory of the layer: the parts of
// its path not on the chain are checked, top down, without following
// anything. With create, missing directories are made (0755, root's, as the
// archive did not say; each counts as an entry); without, a missing one is
// an error. dir becomes the chain.
func (u *unpacker) knownDir(dir string, create bool) error {
	var todo []string
	for d := dir; !onChain(d, u.chain); d = path.Dir(d) {
		todo = append(todo, d)
	}
	for i := len(todo) - 1; i >= 0; i-- {
		if err := u.checkDir(todo[i], create); err != nil {
			return err
		}
		u.chain = todo[i]
	}
	return nil
}

// checkDir checks (or makes) dir, whose parent is known.
func (u *unpacker) checkDir(dir string, create bool) error {
	parent, err := u.parentFD(path.Dir(dir))
	if err != nil {
		return err
	}
	base := path.Base(dir)
	var st unix.Stat_t
	err = unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR:
		return nil
	case err == nil:
		return invalidf("%s: entries are placed under %q, which is not a directory", u.label, dir)
	case errors.Is(err, unix.ENOENT) && create:
	case errors.Is(err, unix.ENOENT):
		return invalidf("%s: directory %q does not exist", u.label, dir)
	default:
		return fmt.Errorf("%s: %s: %w", u.label, dir, err)
	}
	if err := u.budget.addFile(); err != nil {
		return err
	}
	if err := unix.Mkdirat(parent, base, 0o700); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, dir, err)
	}
	fd, err := unix.Openat(parent, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, dir, err)
	}
	err = unix.Fchmod(fd, 0o755) // whatever the umask
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, dir, err)
	}
	u.stats.files++
	return nil
}

// parentFD returns an open descriptor of dir, a known directory: the one
// open already if it is the same (entries come grouped by directory).
// Whatever is made or removed in it goes through this descriptor, and its
// times are put back when it is closed.
func (u *unpacker) parentFD(dir string) (int, error) {
	if u.parent != nil && u.parentName == dir {
		return int(u.parent.Fd()), nil
	}
	var f *os.File
	if u.parent != nil && dir != "." && path.Dir(dir) == u.parentName {
		// One level down from the open one (knownDir checks a path top
		// down): one name to resolve, not the whole path again. It is
		// charged all the same: entries alternating between two deep
		// chains go down one of them, a name at a time, for each entry.
		if err := u.budget.walk(1); err != nil {
			return -1, err
		}
		fd, err := unix.Openat(int(u.parent.Fd()), path.Base(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("%s: %s: %w", u.label, dir, err)
		}
		f = os.NewFile(uintptr(fd), dir)
	} else if err := u.budget.walk(strings.Count(dir, "/") + 1); err != nil {
		return -1, err
	}
	if err := u.closeParent(); err != nil {
		if f != nil {
			f.Close()
		}
		return -1, err
	}
	if f == nil {
		var err error
		if f, err = u.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0); err != nil {
			return -1, fmt.Errorf("%s: %w", u.label, err)
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return -1, fmt.Errorf("%s: %s: %w", u.label, dir, err)
	}
	u.parent, u.parentName = f, dir
	u.parentTimes = []unix.Timespec{st.Atim, st.Mtim}
	return int(f.Fd()), nil
}

// closeParent puts the open parent's times back and closes it.
func (u *unpacker) closeParent() error {
	if u.parent == nil {
		return nil
	}
	err := unix.UtimesNanoAt(int(u.parent.Fd()), ".", u.parentTimes, 0)
	u.parent.Close()
	name := u.parentName
	u.parent, u.parentName = nil, ""
	if err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	return nil
}

// prepare makes name's parent a known directory, removes what this layer
// already has at name (without following it) unless both are directories,
// and returns the parent's descriptor.
func (u *unpacker) prepare(name string, isDir bool) (parent int, exists bool, err error) {
	dir := path.Dir(name)
	if err := u.knownDir(dir, true); err != nil {
		return -1, false, err
	}
	parent, err = u.parentFD(dir)
	if err != nil {
		return -1, false, err
	}
	var st unix.Stat_t
	err = unix.Fstatat(parent, path.Base(name), &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return parent, false, nil
	}
	if err != nil {
		return -1, false, fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	wasDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if wasDir && isDir {
		return parent, true, nil
	}
	if wasDir && onChain(name, u.chain) {
		u.chain = dir
	}
	// One unlinkat in the parent, unless a directory has entries.
	flags := 0
	if wasDir {
		flags = unix.AT_REMOVEDIR
	}
	err = unix.Unlinkat(parent, path.Base(name), flags)
	if errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) {
		err = u.root.RemoveAll(name)
	}
	if err != nil {
		return -1, false, fmt.Errorf("%s: replace %s: %w", u.label, name, err)
	}
	return parent, false, nil
}

func (u *unpacker) dir(name string, hdr *tar.Header) error {
	var fd int
	if name == "." {
		f, err := u.root.Open(".")
		if err != nil {
			return fmt.Errorf("%s: %w", u.label, err)
		}
		defer f.Close()
		fd = int(f.Fd())
	} else {
		parent, exists, err := u.prepare(name, true)
		if err != nil {
			return err
		}
		base := path.Base(name)
		if !exists {
			if err := unix.Mkdirat(parent, base, 0o700); err != nil {
				return fmt.Errorf("%s: %s: %w", u.label, name, err)
			}
		}
		fd, err = unix.Openat(parent, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", u.label, name, err)
		}
		defer unix.Close(fd)
		u.chain = name
	}
	if err := u.attrs(fd, name, hdr); err != nil {
		return err
	}
	ts := timespecs(accessTime(hdr), hdr.ModTime)
	if err := u.setTimes(fd, ".", name, ts); err != nil {
		return err
	}
	if u.parent != nil && u.parentName == name {
		u.parentTimes = ts // what closing it puts back
	}
	u.stats.files++
	return nil
}

func (u *unpacker) file(tr *tar.Reader, name string, hdr *tar.Header) error {
	// The whole size is charged first (a sparse file's holes included):
	// too big a file is refused before any of it is written.
	if err := u.budget.write(hdr.Size); err != nil {
		return err
	}
	parent, _, err := u.prepare(name, false)
	if err != nil {
		return err
	}
	base := path.Base(name)
	fd, err := unix.Openat(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	if err := u.contents(f, tr, name, hdr); err != nil {
		return err
	}
	if err := u.attrs(fd, name, hdr); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	if err := u.setTimes(parent, base, name, timespecs(accessTime(hdr), hdr.ModTime)); err != nil {
		return err
	}
	u.stats.size += hdr.Size
	u.stats.files++
	return nil
}

// contents copies a regular file's data. The recipe gets a reference to the
// file instead of the bytes; a sparse file's stream is not its contents, so
// that stream is recorded as it is, and the file is written with its holes
// left as holes.
func (u *unpacker) contents(f *os.File, tr *tar.Reader, name string, hdr *tar.Header) error {
	var w io.Writer = f
	var holes *HoleWriter
	if isSparse(hdr) {
		holes = &HoleWriter{F: f}
		w = holes
	} else if hdr.Size > 0 {
		u.rec.rw.file(name, hdr.Size)
		u.rec.paused = true
		defer func() { u.rec.paused = false }()
	}
	if u.buf == nil {
		u.buf = make([]byte, 256<<10)
	}
	for {
		n, rerr := tr.Read(u.buf)
		if n > 0 {
			if _, err := w.Write(u.buf[:n]); err != nil {
				return fmt.Errorf("%s: %s: %w", u.label, name, err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return &tarError{rerr}
		}
	}
	if holes != nil {
		return holes.Finish()
	}
	return nil
}

func (u *unpacker) symlink(name string, hdr *tar.Header) error {
	if hdr.Linkname == "" {
		return invalidf("%s: symlink %q has no target", u.label, hdr.Name)
	}
	if len(hdr.Linkname) >= maxEntryName || strings.ContainsRune(hdr.Linkname, 0) {
		return invalidf("%s: symlink %q has a target of %d bytes or one holding a NUL (at most %d bytes)", u.label, hdr.Name, len(hdr.Linkname), maxEntryName-1)
	}
	parent, _, err := u.prepare(name, false)
	if err != nil {
		return err
	}
	base := path.Base(name)
	// The target is stored as it is: it is only ever followed inside the
	// sandbox, never by cage.
	if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	u.stats.dropped += countXattrs(hdr) // Linux allows no user.* xattrs on symlinks
	if err := unix.Fchownat(parent, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	if err := u.setTimes(parent, base, name, timespecs(accessTime(hdr), hdr.ModTime)); err != nil {
		return err
	}
	u.stats.files++
	return nil
}

// hardlink links name to an earlier file or symlink of this layer, never to
// anything else: the target's parent must be a real directory of the layer
// (the layer's directory started empty, so what is in it this layer made),
// and the link is made with linkat on single components without following
// the target.
func (u *unpacker) hardlink(name string, hdr *tar.Header) error {
	target, ok := cleanEntryName(hdr.Linkname)
	if !ok {
		return invalidf("%s: hard link %q points outside the layer (%q)", u.label, hdr.Name, hdr.Linkname)
	}
	if target == name {
		return invalidf("%s: hard link %q points to itself", u.label, hdr.Name)
	}
	notEarlier := invalidf("%s: hard link %q points to %q, which is not an earlier file of the layer", u.label, hdr.Name, hdr.Linkname)
	if err := u.knownDir(path.Dir(target), false); errors.Is(err, ErrInvalid) {
		return notEarlier
	} else if err != nil {
		return err
	}
	if err := u.budget.walk(strings.Count(target, "/") + 1); err != nil {
		return err
	}
	tdir, err := u.root.OpenFile(path.Dir(target), os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", u.label, err)
	}
	defer tdir.Close()
	var st unix.Stat_t
	err = unix.Fstatat(int(tdir.Fd()), path.Base(target), &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return notEarlier
	}
	if err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, target, err)
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFLNK {
		return notEarlier // a directory, or a whiteout
	}
	parent, _, err := u.prepare(name, false)
	if err != nil {
		return err
	}
	if err := unix.Linkat(int(tdir.Fd()), path.Base(target), parent, path.Base(name), 0); err != nil {
		return fmt.Errorf("%s: hard link %s to %s: %w", u.label, name, target, err)
	}
	u.stats.files++
	return nil
}

// whiteout turns OCI whiteouts into overlayfs's: ".wh.NAME" becomes a
// character device 0:0 called NAME, and ".wh..wh..opq" marks its directory
// opaque with the trusted.overlay.opaque xattr (which the archive itself can
// never set: see attrs). The device has the entry's times, as every other
// entry does: it had the moment of its making, so two imports of the same
// layer unpacked two different trees (TestExportRoundTrip, when they fell
// on either side of a second).
func (u *unpacker) whiteout(name string, hdr *tar.Header) error {
	dir, base := path.Dir(name), path.Base(name)
	if base == ".wh..wh..opq" {
		return u.opaque(dir)
	}
	hidden := strings.TrimPrefix(base, ".wh.")
	if hidden == "" || hidden == "." || hidden == ".." || strings.HasPrefix(hidden, ".wh.") {
		return invalidf("%s: entry %q is not a valid whiteout", u.label, name)
	}
	target := path.Join(dir, hidden)
	parent, _, err := u.prepare(target, false)
	if err != nil {
		return err
	}
	if err := unix.Mknodat(parent, hidden, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("%s: whiteout %s: %w", u.label, target, err)
	}
	if err := u.setTimes(parent, hidden, target, timespecs(accessTime(hdr), hdr.ModTime)); err != nil {
		return err
	}
	u.stats.files++
	return nil
}

func (u *unpacker) opaque(dir string) error {
	if err := u.knownDir(dir, true); err != nil {
		return err
	}
	if err := u.budget.walk(strings.Count(dir, "/") + 1); err != nil {
		return err
	}
	f, err := u.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", u.label, err)
	}
	defer f.Close()
	if err := unix.Fsetxattr(int(f.Fd()), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		return fmt.Errorf("%s: mark %s opaque: %w", u.label, dir, err)
	}
	u.stats.files++
	return nil
}
