package volume

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// The content API's operations on a volume's files. Sandboxes write the
// same files (root inside included), so nothing found in a volume is
// trusted: no symbolic link is ever followed (every lookup is openat2 from
// a descriptor of the volume's root or of a directory opened that way, with
// RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS|RESOLVE_NO_XDEV),
// the last component is acted on with *at calls that do not follow it,
// files are opened O_NOFOLLOW|O_NONBLOCK and refused unless they are
// regular (a FIFO neither blocks nor is read), writes go to a new file that
// is renamed into place (a hard link or a symlink at the name is replaced,
// never written through), and walks are bounded.

// Bounds of the walks.
const (
	MaxListDepth   = 64       // depth a listing may ask for
	MaxListEntries = 10000    // entries one listing returns
	MaxListBytes   = 16 << 20 // bytes of one listing's paths, names and targets, as JSON writes them
	maxRemoveDepth = 256      // directories a removal descends
	maxID          = 65535    // uids and gids a request may give (a sandbox's range)
	maxMode        = 0o7777   // permission bits, setuid, setgid and sticky
)

// beneath is how every path in a volume resolves.
const beneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// Root is an open volume: a descriptor of its file system's root.
type Root struct {
	f       *os.File
	dev     uint64
	release func() // OpenHeld's hold, let go at Close
}

// File is the descriptor of the volume's root, for a wall to clone the
// mount from (open_tree with AT_EMPTY_PATH).
func (r *Root) File() *os.File { return r.f }

// Close closes the descriptor (and lets go of OpenHeld's hold).
func (r *Root) Close() error {
	err := r.f.Close()
	if r.release != nil {
		r.release()
	}
	return err
}

func (r *Root) fd() int { return int(r.f.Fd()) }

// Entry is one file of a volume, as E2B's VolumeEntryStat.
type Entry struct {
	Name, Path, Type    string // type: file, directory, symlink, unknown
	Size                int64
	Mode                uint32 // permission bits (with setuid, setgid, sticky)
	UID, GID            uint32
	Atime, Mtime, Ctime time.Time
	Target              string // a symlink's target
}

// Meta is what a request may set on an entry; nil fields are left alone
// (or the defaults, on a new entry).
type Meta struct {
	UID, GID *uint32
	Mode     *uint32
}

// Check refuses ids outside a sandbox's range and modes beyond 07777.
func (m Meta) Check() error {
	for _, v := range []*uint32{m.UID, m.GID} {
		if v != nil && *v > maxID {
			return fmt.Errorf("%w: uid and gid must be between 0 and %d", ErrInvalid, maxID)
		}
	}
	if m.Mode != nil && *m.Mode > maxMode {
		return fmt.Errorf("%w: mode %#o: only permission bits (at most 07777)", ErrInvalid, *m.Mode)
	}
	return nil
}

// Clean turns a requested path into "/a/b" form (relative paths are taken
// from the volume's root; ".." stops at it).
func Clean(p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("%w: path is empty", ErrInvalid)
	}
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("%w: path contains a NUL byte", ErrInvalid)
	}
	return path.Clean("/" + p), nil
}

// pathErr gives an errno the package's kinds, with the path.
func pathErr(op, p string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w: %s", ErrNotFound, p)
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%w: %s %s: the path is or passes through a symbolic link, which the volume API does not follow", ErrInvalid, op, p)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%w: %s %s: a component of the path is not a directory", ErrInvalid, op, p)
	case errors.Is(err, unix.EISDIR):
		return fmt.Errorf("%w: %s %s: is a directory", ErrInvalid, op, p)
	case errors.Is(err, unix.EEXIST), errors.Is(err, unix.ENOTEMPTY):
		return fmt.Errorf("%w: %s %s", ErrExists, op, p)
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return fmt.Errorf("%w: %s %s", ErrNoSpace, op, p)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%w: %s %s: crosses into another file system", ErrInvalid, op, p)
	case errors.Is(err, unix.ENAMETOOLONG):
		return fmt.Errorf("%w: %s %s: name too long", ErrInvalid, op, p)
	case errors.Is(err, unix.ENXIO), errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
		// A socket, or a device node (the volume is mounted nodev).
		return fmt.Errorf("%w: %s %s: not a regular file or directory the API can open", ErrInvalid, op, p)
	}
	return fmt.Errorf("%s %s: %w", op, p, err)
}

// openBeneath opens rel (relative, "" or "." for dir itself) under dir,
// following nothing.
func openBeneath(dir int, rel string, flags int) (int, error) {
	if rel == "" {
		rel = "."
	}
	return unix.Openat2(dir, rel, &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: beneath})
}

// parent opens the directory holding p's last component (O_PATH) and
// returns it with that component. p is clean and not "/".
func (r *Root) parent(p string) (int, string, error) {
	dir, name := path.Split(p)
	fd, err := openBeneath(r.fd(), strings.Trim(dir, "/"), unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return -1, "", pathErr("open", dir, err)
	}
	return fd, name, nil
}

// entryOf describes a file from its lstat.
func entryOf(p string, st *unix.Stat_t) Entry {
	e := Entry{Name: path.Base(p), Path: p, Size: st.Size, Mode: st.Mode & maxMode, UID: st.Uid, GID: st.Gid,
		Atime: time.Unix(st.Atim.Sec, st.Atim.Nsec).UTC(), Mtime: time.Unix(st.Mtim.Sec, st.Mtim.Nsec).UTC(),
		Ctime: time.Unix(st.Ctim.Sec, st.Ctim.Nsec).UTC(), Type: "unknown"}
	if p == "/" {
		e.Name = "/"
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		e.Type = "file"
	case unix.S_IFDIR:
		e.Type = "directory"
	case unix.S_IFLNK:
		e.Type = "symlink"
	}
	return e
}

// statAt describes name in dir, not following it.
func statAt(dir int, name, p string) (Entry, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return Entry{}, pathErr("stat", p, err)
	}
	e := entryOf(p, &st)
	if e.Type == "symlink" {
		buf := make([]byte, 4096)
		if n, err := unix.Readlinkat(dir, name, buf); err == nil {
			e.Target = string(buf[:n])
		}
	}
	return e, nil
}

// Stat describes the entry at p (a symlink itself, never its target).
func (r *Root) Stat(p string) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if p == "/" {
		var st unix.Stat_t
		if err := unix.Fstat(r.fd(), &st); err != nil {
			return Entry{}, pathErr("stat", p, err)
		}
		return entryOf(p, &st), nil
	}
	dir, name, err := r.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dir)
	return statAt(dir, name, p)
}

// List returns the entries under the directory p, depth levels deep (1:
// its own entries), sorted by path.
func (r *Root) List(p string, depth int) ([]Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 || depth > MaxListDepth {
		return nil, fmt.Errorf("%w: depth must be between 1 and %d", ErrInvalid, MaxListDepth)
	}
	fd, err := openBeneath(r.fd(), strings.TrimPrefix(p, "/"), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
	if err != nil {
		return nil, pathErr("list", p, err)
	}
	l := &lister{}
	err = l.listAt(fd, p, depth)
	unix.Close(fd)
	if err != nil {
		return nil, err
	}
	out := l.out
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// lister is one listing: its entries and what their names cost.
type lister struct {
	out   []Entry
	bytes int // of the entries' paths, names and targets, as JSON writes them
}

// jsonLen is the bytes encoding/json writes for s (without its quotes): a
// control character, <, >, &, U+2028, U+2029 and each byte of invalid
// UTF-8 take six. A sandbox names the files: 255 bytes of \x01 are 1,530.
func jsonLen(s string) int {
	n := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				n += 2
			case c < 0x20 || c == '<' || c == '>' || c == '&':
				n += 6
			default:
				n++
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1, r == '\u2028', r == '\u2029':
			n += 6
		default:
			n += size
		}
		i += size
	}
	return n
}

// listAt appends the entries of the directory fd (p in the volume) and,
// while depth allows, of its subdirectories. A sandbox makes an entry's
// path as long as the depth allows (64 names of 255 bytes), and hard links
// to one symlink of a 4095-byte target each carry the target, without
// taking the volume's space: the listing stops at MaxListBytes of names as
// JSON writes them. Found by review, 2026-12-04: 10,000 such links at the
// end of a chain were served, 196 MiB of strings in the daemon and some
// 1.2 GB of JSON per request.
func (l *lister) listAt(fd int, p string, depth int) error {
	tooMany := fmt.Errorf("%w: more than %d entries under the path; list with a smaller depth", ErrTooLarge, MaxListEntries)
	tooLong := fmt.Errorf("%w: the entries' paths, names and targets under the path are more than %d MiB; list with a smaller depth or from deeper", ErrTooLarge, MaxListBytes>>20)
	names, more, err := readNames(fd, MaxListEntries-len(l.out))
	if err != nil {
		return pathErr("list", p, err)
	}
	if more {
		return tooMany
	}
	for _, n := range names {
		if len(l.out) >= MaxListEntries {
			return tooMany
		}
		child := path.Join(p, n)
		if l.bytes += jsonLen(child) + jsonLen(n); l.bytes > MaxListBytes {
			return tooLong
		}
		e, err := statAt(fd, n, child)
		if errors.Is(err, ErrNotFound) {
			continue // removed meanwhile
		}
		if err != nil {
			return err
		}
		if l.bytes += jsonLen(e.Target); l.bytes > MaxListBytes {
			return tooLong
		}
		l.out = append(l.out, e)
		if e.Type != "directory" || depth <= 1 {
			continue
		}
		sub, err := openBeneath(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
		if err != nil {
			continue // replaced meanwhile (by a symlink, say): not followed
		}
		err = l.listAt(sub, child, depth-1)
		unix.Close(sub)
		if err != nil {
			return err
		}
	}
	return nil
}

// readNames lists a directory descriptor's names, at most max of them (a
// duplicate is read, so fd stays usable); more says there were others. A
// sandbox may fill a directory with millions of hard links (no inodes
// needed): the host reads no more than it keeps.
func readNames(fd, max int) (names []string, more bool, err error) {
	err = eachNames(fd, func(batch []string) bool {
		names = append(names, batch...)
		if len(names) > max {
			names, more = names[:max], true
			return false
		}
		return true
	})
	return names, more, err
}

// eachNames calls fn with a directory descriptor's names, a batch at a
// time, until they end or fn says stop (a duplicate is read, so fd stays
// usable).
func eachNames(fd int, fn func([]string) bool) error {
	dup, err := unix.Openat2(fd, ".", &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		return err
	}
	d := os.NewFile(uintptr(dup), "dir")
	defer d.Close()
	for {
		batch, err := d.Readdirnames(1024)
		if len(batch) > 0 && !fn(batch) {
			return nil
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// MakeDir makes the directory p with meta (default: owned by UserID,
// 0755); parents makes the missing directories above it too (owned by
// UserID, 0755), and then an existing p is no error.
func (r *Root) MakeDir(p string, meta Meta, parents bool) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := meta.Check(); err != nil {
		return Entry{}, err
	}
	if p == "/" {
		if parents {
			return r.Stat(p)
		}
		return Entry{}, fmt.Errorf("%w: mkdir /", ErrExists)
	}
	dirPath := path.Dir(p)
	if parents {
		if err := r.mkdirAll(dirPath); err != nil {
			return Entry{}, err
		}
	}
	dir, name, err := r.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dir)
	mode := uint32(0o755)
	if meta.Mode != nil {
		mode = *meta.Mode
	}
	err = unix.Mkdirat(dir, name, 0o700)
	if errors.Is(err, unix.EEXIST) && parents {
		return statDir(dir, name, p)
	}
	if err != nil {
		return Entry{}, pathErr("mkdir", p, err)
	}
	fd, err := openBeneath(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
	if err != nil {
		return Entry{}, pathErr("mkdir", p, err)
	}
	defer unix.Close(fd)
	if err := setMeta(fd, false, meta.orDefault(mode)); err != nil {
		return Entry{}, pathErr("mkdir", p, err)
	}
	return statAt(dir, name, p)
}

// statDir describes an existing name that must be a directory.
func statDir(dir int, name, p string) (Entry, error) {
	e, err := statAt(dir, name, p)
	if err == nil && e.Type != "directory" {
		err = fmt.Errorf("%w: mkdir %s: exists and is not a directory", ErrExists, p)
	}
	return e, err
}

// mkdirAll makes the directories of p that are missing, each owned by
// UserID, 0755, following nothing.
func (r *Root) mkdirAll(p string) error {
	cur, err := unix.FcntlInt(uintptr(r.fd()), unix.F_DUPFD_CLOEXEC, 0) // a fork meanwhile (QEMU's jail) must not inherit it
	if err != nil {
		return err
	}
	defer func() { unix.Close(cur) }()
	done := "/"
	for _, c := range strings.Split(strings.Trim(p, "/"), "/") {
		if c == "" {
			continue
		}
		done = path.Join(done, c)
		err := unix.Mkdirat(cur, c, 0o700)
		created := err == nil
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return pathErr("mkdir", done, err)
		}
		next, err := openBeneath(cur, c, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
		if err != nil {
			return pathErr("mkdir", done, err)
		}
		if created {
			if err := setMeta(next, false, Meta{}.orDefault(0o755)); err != nil {
				unix.Close(next)
				return pathErr("mkdir", done, err)
			}
		}
		unix.Close(cur)
		cur = next
	}
	return nil
}

// orDefault fills meta's missing owner with UserID and mode with mode.
func (m Meta) orDefault(mode uint32) Meta {
	uid, gid := uint32(UserID), uint32(UserID)
	if m.UID == nil {
		m.UID = &uid
	}
	if m.GID == nil {
		m.GID = &gid
	}
	if m.Mode == nil {
		m.Mode = &mode
	}
	return m
}

// setMeta changes the owner and mode of the file fd (O_PATH or open; a
// symlink's when link: its mode is not changed) as meta says.
func setMeta(fd int, link bool, meta Meta) error {
	if meta.UID != nil || meta.GID != nil {
		uid, gid := -1, -1
		if meta.UID != nil {
			uid = int(*meta.UID)
		}
		if meta.GID != nil {
			gid = int(*meta.GID)
		}
		if err := unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if meta.Mode != nil {
		if link {
			return fmt.Errorf("%w: a symbolic link has no mode of its own", ErrInvalid)
		}
		// The descriptor names the inode itself: its /proc link is not a
		// path anyone can swap.
		if err := unix.Fchmodat(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(fd), *meta.Mode, 0); err != nil {
			return err
		}
	}
	return nil
}

// SetMeta changes the owner and mode of the entry at p (a symlink's owner
// only, never its target's).
func (r *Root) SetMeta(p string, meta Meta) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := meta.Check(); err != nil {
		return Entry{}, err
	}
	fd, err := openBeneath(r.fd(), strings.TrimPrefix(p, "/"), unix.O_PATH|unix.O_NOFOLLOW)
	if err != nil {
		return Entry{}, pathErr("update", p, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Entry{}, pathErr("update", p, err)
	}
	if err := setMeta(fd, st.Mode&unix.S_IFMT == unix.S_IFLNK, meta); err != nil {
		return Entry{}, pathErr("update", p, err)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		return Entry{}, pathErr("update", p, err)
	}
	return entryOf(p, &st), nil
}

// Open opens the regular file at p for reading (never a symlink, FIFO or
// device), with its description.
func (r *Root) Open(p string) (*os.File, Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return nil, Entry{}, err
	}
	fd, err := openBeneath(r.fd(), strings.TrimPrefix(p, "/"), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK)
	if err != nil {
		return nil, Entry{}, pathErr("read", p, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, Entry{}, pathErr("read", p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, Entry{}, fmt.Errorf("%w: read %s: not a regular file", ErrInvalid, p)
	}
	return os.NewFile(uintptr(fd), p), entryOf(p, &st), nil
}

// Write makes the file p hold what body gives (created, or replaced: a
// symlink or hard link at p is replaced, never written through), with
// meta (default: owned by UserID, 0644). parents makes missing directories
// above it. Nothing is left of a write that fails.
func (r *Root) Write(p string, body io.Reader, meta Meta, parents bool) (Entry, error) {
	p, err := Clean(p)
	if err != nil {
		return Entry{}, err
	}
	if err := meta.Check(); err != nil {
		return Entry{}, err
	}
	if p == "/" {
		return Entry{}, fmt.Errorf("%w: write /: is a directory", ErrInvalid)
	}
	if parents {
		if err := r.mkdirAll(path.Dir(p)); err != nil {
			return Entry{}, err
		}
	}
	dir, name, err := r.parent(p)
	if err != nil {
		return Entry{}, err
	}
	defer unix.Close(dir)
	tmp := tmpName()
	fd, err := unix.Openat(dir, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return Entry{}, pathErr("write", p, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	defer f.Close()
	keep := false
	defer func() {
		if !keep {
			_ = unix.Unlinkat(dir, tmp, 0)
		}
	}()
	buf := make([]byte, 1<<20)
	if _, err := io.CopyBuffer(struct{ io.Writer }{f}, body, buf); err != nil {
		return Entry{}, pathErr("write", p, err)
	}
	if err := setMeta(fd, false, meta.orDefault(0o644)); err != nil {
		return Entry{}, pathErr("write", p, err)
	}
	var old unix.Stat_t
	if err := unix.Fstatat(dir, name, &old, unix.AT_SYMLINK_NOFOLLOW); err == nil && old.Mode&unix.S_IFMT == unix.S_IFDIR {
		return Entry{}, fmt.Errorf("%w: write %s: is a directory", ErrInvalid, p)
	}
	if err := unix.Renameat(dir, tmp, dir, name); err != nil {
		return Entry{}, pathErr("write", p, err)
	}
	keep = true
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Entry{}, pathErr("write", p, err)
	}
	return entryOf(p, &st), nil
}

// tmpName is a new file's name until it is complete.
func tmpName() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return ".cage-write-" + hex.EncodeToString(b)
}

// Remove removes the entry at p: a file or symlink itself, or a directory
// with everything under it (to maxRemoveDepth levels).
func (r *Root) Remove(p string) error {
	p, err := Clean(p)
	if err != nil {
		return err
	}
	if p == "/" {
		return fmt.Errorf("%w: the volume's root cannot be removed", ErrInvalid)
	}
	dir, name, err := r.parent(p)
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	return pathErr("remove", p, removeAt(dir, name, 0))
}

// removeAt removes name in dir, descending into directories through
// descriptors opened without following anything.
func removeAt(dir int, name string, depth int) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return unix.Unlinkat(dir, name, 0)
	}
	if depth >= maxRemoveDepth {
		return fmt.Errorf("%w: the tree is more than %d directories deep; remove its depths first (from inside a sandbox)", ErrTooLarge, maxRemoveDepth)
	}
	fd, err := openBeneath(dir, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for pass := 0; ; pass++ {
		names, _, err := readNames(fd, 1)
		if err != nil {
			return err
		}
		if len(names) == 0 {
			break
		}
		if pass == 3 {
			return fmt.Errorf("%w: a directory under it keeps filling while it is removed", ErrExists)
		}
		// A batch at a time: the directory may hold millions of names.
		var rmErr error
		if err := eachNames(fd, func(batch []string) bool {
			for _, n := range batch {
				if err := removeAt(fd, n, depth+1); err != nil && !errors.Is(err, unix.ENOENT) {
					rmErr = err
					return false
				}
			}
			return true
		}); err != nil {
			return err
		}
		if rmErr != nil {
			return rmErr
		}
	}
	return unix.Unlinkat(dir, name, unix.AT_REMOVEDIR)
}
