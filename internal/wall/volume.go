package wall

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Clone makes a detached copy of the volume's host mount, cloned from its
// root's descriptor (never a path), nosuid and nodev, idmapped through the
// user namespace userns unless userns is -1: with the sandbox's namespace
// (or one of the same map), a file the volume keeps as uid 1000 is the
// sandbox's user's and what that user writes is kept as 1000, whatever the
// sandbox's host uid range. The caller attaches it (move_mount) and
// closes it.
func (v Volume) Clone(userns int) (int, error) {
	fd, err := unix.OpenTree(int(v.Root.Fd()), "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return -1, fmt.Errorf("volume at %s: clone its mount: %w", v.Path, err)
	}
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	if userns >= 0 {
		attr.Attr_set |= unix.MOUNT_ATTR_IDMAP
		attr.Userns_fd = uint64(userns)
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("volume at %s: idmapped mount: %w", v.Path, err)
	}
	return fd, nil
}
