package imgstore

// Unpacking one layer of a hostile archive into its own directory, in the
// form overlayfs wants for a lower layer.
//
// Every entry's parent is first made a known, real directory of the layer
// (walked with Lstat: a symlink on the way is an error, not something to
// follow), then opened through the layer's os.Root, and the entry itself is
// made with an *at system call on that single component. So a symlink the
// archive planted earlier can never carry a write outside the layer, and the
// os.Root stays the last line of defence should that bookkeeping be wrong.

import (
	"archive/tar"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	maxEntryName = 4096 // PATH_MAX: longer names are refused
	maxID        = 65535
)

// budget bounds what one import reads (decompression bombs) and makes.
type budget struct {
	maxBytes int64
	maxFiles int
	read     int64 // uncompressed bytes read, tar headers included
	written  int64 // bytes of sparse files as written out
	files    int
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
		errors.As(err, &corrupt) || errors.Is(err, io.ErrUnexpectedEOF) {
		return invalidf("corrupt compressed layer: %v", err)
	}
	return err
}

// tarError is an error of the tar reader, told apart from errors of the
// filesystem while an entry is written.
type tarError struct{ err error }

func (e *tarError) Error() string { return e.err.Error() }
func (e *tarError) Unwrap() error { return e.err }

// layerStats is what unpacking a layer found.
type layerStats struct {
	size    int64 // bytes of regular files
	files   int   // entries made
	skipped int   // devices, FIFOs and other entries not made
	dropped int   // xattrs not kept
}

type entryTime struct {
	name         string
	atime, mtime time.Time
}

// unpacker writes one layer's entries under root.
type unpacker struct {
	root   *os.Root
	label  string // "layer 2/3 sha256:…", for messages
	budget *budget
	rec    *recorder

	dirs     map[string]bool // names known to be real directories of the layer
	seen     map[string]bool // non-directories made by this layer (hard link targets)
	dirTimes []entryTime     // set last: making entries changes their directory's times

	parentName string   // cached open parent directory
	parent     *os.File //
	buf        []byte   // for copying file contents
	stats      layerStats
}

func newUnpacker(root *os.Root, label string, b *budget, rec *recorder) *unpacker {
	return &unpacker{
		root: root, label: label, budget: b, rec: rec,
		dirs: map[string]bool{".": true},
		seen: map[string]bool{},
	}
}

// run unpacks every entry of tr.
func (u *unpacker) run(tr *tar.Reader) error {
	defer u.closeParent()
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return &tarError{err}
		}
		if err := u.budget.addFile(); err != nil {
			return err
		}
		if err := u.entry(tr, hdr); err != nil {
			return err
		}
	}
	return u.setDirTimes()
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
		return u.whiteout(name)
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

// knownDir makes sure dir is a real directory of the layer, walking up with
// Lstat. With create, missing directories are made (0755, root's, as the
// archive did not say); without, a missing one is an error.
func (u *unpacker) knownDir(dir string, create bool) error {
	if u.dirs[dir] {
		return nil
	}
	if err := u.knownDir(path.Dir(dir), create); err != nil {
		return err
	}
	fi, err := u.root.Lstat(dir)
	switch {
	case err == nil && fi.IsDir():
	case err == nil:
		return invalidf("%s: entries are placed under %q, which is not a directory", u.label, dir)
	case errors.Is(err, fs.ErrNotExist) && create:
		if err := u.root.Mkdir(dir, 0o755); err != nil {
			return fmt.Errorf("%s: %w", u.label, err)
		}
		if err := u.root.Chmod(dir, 0o755); err != nil { // whatever the umask
			return fmt.Errorf("%s: %w", u.label, err)
		}
	case errors.Is(err, fs.ErrNotExist):
		return invalidf("%s: directory %q does not exist", u.label, dir)
	default:
		return fmt.Errorf("%s: %w", u.label, err)
	}
	u.dirs[dir] = true
	return nil
}

// parentFD returns an open descriptor of dir, a known directory: the one
// cached if it is the same (entries come grouped by directory).
func (u *unpacker) parentFD(dir string) (int, error) {
	if u.parent != nil && u.parentName == dir {
		return int(u.parent.Fd()), nil
	}
	u.closeParent()
	f, err := u.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, fmt.Errorf("%s: %w", u.label, err)
	}
	u.parent, u.parentName = f, dir
	return int(f.Fd()), nil
}

func (u *unpacker) closeParent() {
	if u.parent != nil {
		u.parent.Close()
		u.parent, u.parentName = nil, ""
	}
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
	base := path.Base(name)
	var st unix.Stat_t
	err = unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW)
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
	if err := u.remove(name, wasDir); err != nil {
		return -1, false, err
	}
	parent, err = u.parentFD(dir)
	return parent, false, err
}

// remove deletes name (a directory with its contents) from the layer.
func (u *unpacker) remove(name string, isDir bool) error {
	if isDir {
		// Every known directory below it goes; rather than search the
		// map, forget them all: the next entries re-check their parents.
		u.closeParent()
		clear(u.dirs)
		u.dirs["."] = true
	}
	delete(u.seen, name)
	if err := u.root.RemoveAll(name); err != nil {
		return fmt.Errorf("%s: replace %s: %w", u.label, name, err)
	}
	return nil
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
		u.dirs[name] = true
	}
	if err := u.attrs(fd, name, hdr); err != nil {
		return err
	}
	u.dirTimes = append(u.dirTimes, entryTime{name, accessTime(hdr), hdr.ModTime})
	u.stats.files++
	return nil
}

func (u *unpacker) file(tr *tar.Reader, name string, hdr *tar.Header) error {
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
	if err := u.setTimes(parent, base, name, accessTime(hdr), hdr.ModTime); err != nil {
		return err
	}
	u.seen[name] = true
	u.stats.size += hdr.Size
	u.stats.files++
	return nil
}

// contents copies a regular file's data. The recipe gets a reference to the
// file instead of the bytes; a sparse file's stream is not its contents, so
// that stream is recorded as it is, and the bytes it expands to count
// against the bound too (holes cost nothing to compress).
func (u *unpacker) contents(f *os.File, tr *tar.Reader, name string, hdr *tar.Header) error {
	sparse := isSparse(hdr)
	if !sparse && hdr.Size > 0 {
		u.rec.rw.file(name, hdr.Size)
		u.rec.paused = true
		defer func() { u.rec.paused = false }()
	}
	if u.buf == nil {
		u.buf = make([]byte, 256<<10)
	}
	buf := u.buf
	for {
		n, rerr := tr.Read(buf)
		if sparse {
			u.budget.written += int64(n)
			if u.budget.written > u.budget.maxBytes {
				return u.budget.tooBig()
			}
		}
		if n > 0 {
			if _, err := f.Write(buf[:n]); err != nil {
				return fmt.Errorf("%s: %s: %w", u.label, name, err)
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return &tarError{rerr}
		}
	}
}

// isSparse tells a GNU sparse entry, whose stream holds only the data
// fragments, from a plain one.
func isSparse(hdr *tar.Header) bool {
	if hdr.Typeflag == tar.TypeGNUSparse {
		return true
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

func (u *unpacker) symlink(name string, hdr *tar.Header) error {
	if hdr.Linkname == "" {
		return invalidf("%s: symlink %q has no target", u.label, hdr.Name)
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
	if err := u.setTimes(parent, base, name, accessTime(hdr), hdr.ModTime); err != nil {
		return err
	}
	u.seen[name] = true
	u.stats.files++
	return nil
}

// hardlink links name to an earlier file of this layer, never to anything
// else: the target is looked up among the entries made, its parent must
// still be a real directory of the layer, and the link is made with linkat
// on single components without following the target.
func (u *unpacker) hardlink(name string, hdr *tar.Header) error {
	target, ok := cleanEntryName(hdr.Linkname)
	if !ok {
		return invalidf("%s: hard link %q points outside the layer (%q)", u.label, hdr.Name, hdr.Linkname)
	}
	if !u.seen[target] {
		return invalidf("%s: hard link %q points to %q, which is not an earlier file of the layer", u.label, hdr.Name, hdr.Linkname)
	}
	if target == name {
		return invalidf("%s: hard link %q points to itself", u.label, hdr.Name)
	}
	if err := u.knownDir(path.Dir(target), false); err != nil {
		return err
	}
	tdir, err := u.root.OpenFile(path.Dir(target), os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", u.label, err)
	}
	defer tdir.Close()
	parent, _, err := u.prepare(name, false)
	if err != nil {
		return err
	}
	if err := unix.Linkat(int(tdir.Fd()), path.Base(target), parent, path.Base(name), 0); err != nil {
		return fmt.Errorf("%s: hard link %s to %s: %w", u.label, name, target, err)
	}
	u.seen[name] = true
	u.stats.files++
	return nil
}

// whiteout turns OCI whiteouts into overlayfs's: ".wh.NAME" becomes a
// character device 0:0 called NAME, and ".wh..wh..opq" marks its directory
// opaque with the trusted.overlay.opaque xattr (which the archive itself can
// never set: see attrs).
func (u *unpacker) whiteout(name string) error {
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
	u.stats.files++
	return nil
}

func (u *unpacker) opaque(dir string) error {
	if err := u.knownDir(dir, true); err != nil {
		return err
	}
	f, err := u.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
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

// attrs sets an entry's xattrs, owner and mode on its open descriptor, in
// that order: chown clears setuid and setgid, so the mode comes last.
func (u *unpacker) attrs(fd int, name string, hdr *tar.Header) error {
	for _, x := range u.keptXattrs(hdr) {
		if err := unix.Fsetxattr(fd, x[0], []byte(x[1]), 0); err != nil {
			return fmt.Errorf("%s: %s: xattr %s: %w", u.label, name, x[0], err)
		}
	}
	if err := unix.Fchown(fd, hdr.Uid, hdr.Gid); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	if err := unix.Fchmod(fd, uint32(hdr.Mode&0o7777)); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	return nil
}

// keptXattrs returns the entry's user.* xattrs, sorted. Everything else is
// dropped and counted: trusted.* (trusted.overlay.* would steer overlayfs),
// security.* (file capabilities, SELinux labels), system.* (ACLs), and
// user.overlay.*, which overlayfs reads in place of trusted.overlay.* when
// mounted with userxattr.
func (u *unpacker) keptXattrs(hdr *tar.Header) [][2]string {
	var kept [][2]string
	for k, v := range hdr.PAXRecords {
		x, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		if strings.HasPrefix(x, "user.") && !strings.HasPrefix(x, "user.overlay.") {
			kept = append(kept, [2]string{x, v})
		} else {
			u.stats.dropped++
		}
	}
	slices.SortFunc(kept, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return kept
}

func countXattrs(hdr *tar.Header) int {
	n := 0
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			n++
		}
	}
	return n
}

func accessTime(hdr *tar.Header) time.Time {
	if hdr.AccessTime.IsZero() {
		return hdr.ModTime
	}
	return hdr.AccessTime
}

// setTimes sets an entry's times without following it.
func (u *unpacker) setTimes(parent int, base, name string, atime, mtime time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	if err := unix.UtimesNanoAt(parent, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: %s: %w", u.label, name, err)
	}
	return nil
}

// setDirTimes sets the directories' times once nothing more is made in them.
func (u *unpacker) setDirTimes() error {
	for _, t := range u.dirTimes {
		if t.name == "." {
			f, err := u.root.Open(".")
			if err != nil {
				return fmt.Errorf("%s: %w", u.label, err)
			}
			err = u.setTimes(int(f.Fd()), ".", ".", t.atime, t.mtime)
			f.Close()
			if err != nil {
				return err
			}
			continue
		}
		// Skip a directory a later entry replaced.
		if err := u.knownDir(t.name, false); err != nil {
			continue
		}
		parent, err := u.parentFD(path.Dir(t.name))
		if err != nil {
			return err
		}
		if err := u.setTimes(parent, path.Base(t.name), t.name, t.atime, t.mtime); err != nil {
			return err
		}
	}
	return nil
}
