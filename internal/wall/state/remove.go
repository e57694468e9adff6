package state

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// RemoveTree removes the tree at path without ever leaving it: no symbolic
// link is followed (every step is openat2 with RESOLVE_NO_SYMLINKS,
// RESOLVE_BENEATH and RESOLVE_NO_XDEV from a descriptor of its parent), and
// a mount found in it (a sandbox's disk or root, a network namespace's
// file, a leftover bind of a template's layer) is detached first, through a
// descriptor of its root, so nothing of another file system is touched. A
// path that does not exist is no error. The parent of path must be a
// directory only root can write (a state directory's parent).
func RemoveTree(path string) error {
	path = filepath.Clean(path)
	parent, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return err
	}
	defer unix.Close(parent)
	if err := removeAt(parent, filepath.Base(path), 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}

// maxTreeDepth bounds the recursion (and the descriptors it holds): the
// trees removed are cage's own directories; a sandbox's files are on its
// own file systems, which are detached, not walked.
const maxTreeDepth = 64

// removeAt removes name in the directory dirfd.
func removeAt(dirfd int, name string, depth int) error {
	if depth > maxTreeDepth {
		return errors.New("tree too deep")
	}
	if err := detachMounts(dirfd, name); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return unix.Unlinkat(dirfd, name, 0)
	}
	fd, err := unix.Openat2(dirfd, name, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH | unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return err
	}
	d := os.NewFile(uintptr(fd), name)
	defer d.Close()
	for pass := 0; ; pass++ {
		if _, err := d.Seek(0, io.SeekStart); err != nil {
			return err
		}
		names, err := d.Readdirnames(-1)
		if err != nil {
			return err
		}
		if len(names) == 0 {
			break
		}
		if pass == 3 {
			return fmt.Errorf("%s keeps filling", name)
		}
		for _, n := range names {
			if err := removeAt(fd, n, depth+1); err != nil && !errors.Is(err, unix.ENOENT) {
				return err
			}
		}
	}
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

// detachMounts detaches whatever is mounted on name in dirfd (mounts may be
// stacked), through a descriptor of each mount's root: the path is never
// resolved again, so nothing planted in it is followed.
func detachMounts(dirfd int, name string) error {
	for i := 0; i < 16; i++ {
		var stx unix.Statx_t
		if err := unix.Statx(dirfd, name, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx); err != nil {
			return err
		}
		if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
			return errors.New("the kernel does not say where mounts are (statx STATX_ATTR_MOUNT_ROOT)")
		}
		if stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
			return nil
		}
		fd, err := unix.Openat2(dirfd, name, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
		})
		if err != nil {
			return err
		}
		err = unix.Unmount("/proc/self/fd/"+strconv.Itoa(fd), unix.MNT_DETACH)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("detach the mount on %s: %w", name, err)
		}
	}
	return fmt.Errorf("more than 16 mounts stacked on %s", name)
}

// IsMountPoint reports whether path (not followed if a symlink) is the root
// of a mount.
func IsMountPoint(path string) bool {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx)
	return err == nil && stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
}
