package agent

import (
	"errors"
	"fmt"
	"path"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Path resolution for the file API: the wall between what a request names
// and the rest of the machine. (What the requesting user may touch inside
// the sandbox is the kernel's to check: every operation runs with the
// user's credentials, see creds.go.)
//
// Every path is opened with openat2(RESOLVE_IN_ROOT|RESOLVE_NO_MAGICLINKS)
// relative to a descriptor of the sandbox root: "..", absolute symlinks and
// relative symlinks that climb all stay below the root, as if the process had
// chrooted into it, and /proc magic links are refused. Operations on a final
// component that must not be followed (lstat, mkdir, rename, unlink) run with
// *at syscalls relative to a parent descriptor opened that way, so a symlink
// swapped into the parent chain during the call cannot lead out either. Trees
// are walked only through descriptors opened without following any symlink.

// inRoot is how every user-supplied path is resolved.
const inRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS

// beneathNoLinks opens one component below a directory, following nothing.
const beneathNoLinks = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

var (
	errRootPath = errors.New("the sandbox root cannot be changed")
	errNoPath   = errors.New("path is empty")
)

// sandboxPath turns a requested path into a clean absolute path inside the
// sandbox: "~" and "~/x" expand to u's home, relative paths are taken from
// u's home, and ".." never climbs above "/".
func sandboxPath(p string, u User) (string, error) {
	if p == "" {
		return "", errNoPath
	}
	if strings.ContainsRune(p, 0) {
		return "", errors.New("path contains a NUL byte")
	}
	home := u.Home
	if home == "" {
		home = "/"
	}
	if p == "~" || strings.HasPrefix(p, "~/") {
		p = home + p[1:]
	} else if strings.HasPrefix(p, "~") {
		return "", errors.New("cannot expand another user's home directory")
	}
	if !path.IsAbs(p) {
		p = path.Join(home, p)
	}
	if strings.ContainsRune(p, 0) {
		return "", errors.New("the user's home directory contains a NUL byte")
	}
	return path.Clean("/" + p), nil
}

// relTo returns sandbox path p relative to the root: "." for "/".
func relTo(p string) string {
	r := strings.TrimLeft(path.Clean("/"+p), "/")
	if r == "" {
		return "."
	}
	return r
}

// fsRoot is an open handle on the sandbox root.
type fsRoot struct {
	fd  int    // O_PATH descriptor of the root directory
	dir string // the root's path in the agent's own mount namespace
}

// openFSRoot opens dir as a sandbox root. The caller must Close it.
func openFSRoot(dir string) (*fsRoot, error) {
	dir = path.Clean(dir)
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open sandbox root: %w", err)
	}
	return &fsRoot{fd: fd, dir: dir}, nil
}

// Close releases the root descriptor.
func (r *fsRoot) Close() error { return unix.Close(r.fd) }

// openat2 retries the transient errors openat2 reports under rename races.
func openat2(dirfd int, name string, how *unix.OpenHow) (int, error) {
	for i := 0; ; i++ {
		fd, err := unix.Openat2(dirfd, name, how)
		if (err == unix.EAGAIN || err == unix.EINTR) && i < 64 {
			continue
		}
		return fd, err
	}
}

// open opens sandbox path p, following symlinks as long as they stay inside
// the root. flags get O_CLOEXEC added.
func (r *fsRoot) open(p string, flags int, mode uint32) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: inRoot}
	return openat2(r.fd, relTo(p), &how)
}

// openBeneath opens name, a single component, in the directory dirfd without
// following any symlink.
func openBeneath(dirfd int, name string, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC), Resolve: beneathNoLinks}
	return openat2(dirfd, name, &how)
}

// parent opens the directory that holds p's final component and returns it
// (O_PATH) with that component's name. p must not be "/".
func (r *fsRoot) parent(p string) (int, string, error) {
	p = path.Clean("/" + p)
	if p == "/" {
		return -1, "", errRootPath
	}
	fd, err := r.open(path.Dir(p), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, "", err
	}
	return fd, path.Base(p), nil
}

// lstat stats p without following its final component.
func (r *fsRoot) lstat(p string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if path.Clean("/"+p) == "/" {
		return st, unix.Fstatat(r.fd, "", &st, unix.AT_EMPTY_PATH)
	}
	dfd, name, err := r.parent(p)
	if err != nil {
		return st, err
	}
	defer unix.Close(dfd)
	return st, unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
}

// metadata returns the file metadata of p (see readMetadata), whose lstat
// mode is mode.
func (r *fsRoot) metadata(p string, mode uint32) map[string]string {
	if path.Clean("/"+p) == "/" {
		return readMetadata(r.fd, "", mode)
	}
	dfd, name, err := r.parent(p)
	if err != nil {
		return nil
	}
	defer unix.Close(dfd)
	return readMetadata(dfd, name, mode)
}

// readlink returns the raw target of the symlink p.
func (r *fsRoot) readlink(p string) (string, error) {
	dfd, name, err := r.parent(p)
	if err != nil {
		return "", err
	}
	defer unix.Close(dfd)
	return readlinkAt(dfd, name)
}

func readlinkAt(dirfd int, name string) (string, error) {
	for size := 256; size <= 1<<16; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
	return "", unix.ENAMETOOLONG
}

// pathOf returns the sandbox path that the descriptor fd refers to, or false
// when the kernel reports a path outside the root.
func (r *fsRoot) pathOf(fd int) (string, bool) {
	host, err := readlinkAt(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(fd))
	if err != nil || !path.IsAbs(host) || strings.HasSuffix(host, " (deleted)") {
		return "", false
	}
	switch {
	case r.dir == "/":
		return host, true
	case host == r.dir:
		return "/", true
	case strings.HasPrefix(host, r.dir+"/"):
		return host[len(r.dir):], true
	}
	return "", false
}

// linkTarget tells where the symlink p leads inside the sandbox: the fully
// resolved path when it resolves, else its target taken lexically from p's
// directory (an absolute target counts from the sandbox root).
func (r *fsRoot) linkTarget(p, raw string) string {
	if fd, err := r.open(p, unix.O_PATH, 0); err == nil {
		got, ok := r.pathOf(fd)
		unix.Close(fd)
		if ok {
			return got
		}
	}
	if path.IsAbs(raw) {
		return path.Clean(raw)
	}
	return path.Join(path.Dir(path.Clean("/"+p)), raw)
}

// mkdirAll makes directory p and any missing parents. It returns an O_PATH
// descriptor of p and whether p was created. New directories belong to
// whoever the calling thread acts as (see asUser): the kernel makes them so.
func (r *fsRoot) mkdirAll(p string) (int, bool, error) {
	p = path.Clean("/" + p)
	fd, err := r.open(p, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != unix.ENOENT || p == "/" {
		return fd, false, err
	}
	pfd, _, err := r.mkdirAll(path.Dir(p))
	if err != nil {
		return -1, false, err
	}
	defer unix.Close(pfd)
	created := false
	switch err := unix.Mkdirat(pfd, path.Base(p), 0o755); err {
	case nil:
		created = true
	case unix.EEXIST: // made concurrently, or a dangling symlink: open decides
	default:
		return -1, false, err
	}
	fd, err = r.open(p, unix.O_PATH|unix.O_DIRECTORY, 0)
	return fd, created, err
}

// rename moves src to dst, making dst's missing parents. Neither final
// component is followed: a symlink is moved or replaced itself.
func (r *fsRoot) rename(src, dst string) error {
	sfd, sname, err := r.parent(src)
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	dst = path.Clean("/" + dst)
	if dst == "/" {
		return errRootPath
	}
	dfd, _, err := r.mkdirAll(path.Dir(dst))
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return unix.Renameat(sfd, sname, dfd, path.Base(dst))
}

// removeAll removes p: a file, a symlink (never what it points to) or a
// whole directory tree. A missing p is ENOENT.
func (r *fsRoot) removeAll(p string) error {
	dfd, name, err := r.parent(p)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return removeAt(dfd, name, 0)
}

// maxRemoveDepth bounds the descriptors one removal holds open.
const maxRemoveDepth = 512

// removeAt removes name from the directory dirfd, descending into
// directories only through descriptors opened without following symlinks.
func removeAt(dirfd int, name string, depth int) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return unix.Unlinkat(dirfd, name, 0)
	}
	if depth >= maxRemoveDepth {
		return unix.ELOOP
	}
	fd, err := openBeneath(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY)
	if err == unix.ELOOP || err == unix.ENOTDIR {
		// Swapped for something else since the stat: remove that instead.
		return unix.Unlinkat(dirfd, name, 0)
	}
	if err != nil {
		return err
	}
	err = removeChildren(fd, depth)
	unix.Close(fd)
	if err != nil {
		return err
	}
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

func removeChildren(fd, depth int) error {
	for pass := 0; pass < 4096; pass++ {
		names, err := readDirNames(fd, 1024)
		if err != nil {
			return err
		}
		if len(names) == 0 {
			return nil
		}
		for _, n := range names {
			if err := removeAt(fd, n, depth+1); err != nil && err != unix.ENOENT {
				return err
			}
		}
		// The directory changed under us; read it again from the start.
		if _, err := unix.Seek(fd, 0, 0); err != nil {
			return err
		}
	}
	return unix.ENOTEMPTY // something keeps refilling it
}

// readDirNames reads up to max entry names (without "." and "..") from the
// directory descriptor fd, from its current offset.
func readDirNames(fd, max int) ([]string, error) {
	var names []string
	buf := make([]byte, 32<<10)
	for len(names) < max {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			break
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
	return names, nil
}
