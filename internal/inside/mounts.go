package inside

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Paths of /proc that are hidden (files: /dev/null bound over them; dirs: an
// empty read-only tmpfs) or made read-only, as container runtimes do.
var (
	procMasked   = []string{"kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms", "acpi", "scsi", "asound", "firmware", "interrupts", "kpagecount", "kpageflags", "kpagecgroup", "vmallocinfo"}
	procReadOnly = []string{"bus", "fs", "irq", "sys", "sysrq-trigger"}
)

// BindMount clones the mount tree at src onto dst with extra attributes set
// on every mount of the tree (a recursive read-only bind that also covers
// submounts, which a classic MS_BIND remount does not).
func BindMount(src, dst string, attrs uint64) error {
	fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("bind %s: open_tree: %w", src, err)
	}
	defer unix.Close(fd)
	if attrs != 0 {
		attr := &unix.MountAttr{Attr_set: attrs}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, attr); err != nil {
			return fmt.Errorf("bind %s: mount_setattr: %w", src, err)
		}
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	return nil
}

// SetAttr sets mount attributes on the mount at path (recursively).
func SetAttr(path string, attrs uint64) error {
	attr := &unix.MountAttr{Attr_set: attrs}
	if err := unix.MountSetattr(unix.AT_FDCWD, path, unix.AT_RECURSIVE, attr); err != nil {
		return fmt.Errorf("mount_setattr %s: %w", path, err)
	}
	return nil
}

// MountProc mounts a fresh /proc for the sandbox's PID namespace and masks
// the paths that reveal or touch the host kernel (the microvm guest's
// sandbox gets the same, for its own kernel). set, when not nil, is given
// the new /proc before its /proc/sys is made read-only: sysctls written
// through it walk only this sandbox's entries, not the host's /proc's
// (procsys).
func MountProc(root string, set func(proc string) error) error {
	proc := filepath.Join(root, "proc")
	if err := os.Mkdir(proc, 0o555); err != nil && !os.IsExist(err) {
		return err
	}
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if set != nil {
		if err := set(proc); err != nil {
			return err
		}
	}
	for _, name := range procMasked {
		p := filepath.Join(proc, name)
		fi, err := os.Lstat(p)
		if err != nil {
			continue // not on this kernel
		}
		if fi.IsDir() {
			err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k,nr_inodes=2,mode=555")
		} else {
			err = BindMount("/dev/null", p, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NOEXEC)
		}
		if err != nil {
			return fmt.Errorf("mask /proc/%s: %w", name, err)
		}
	}
	for _, name := range procReadOnly {
		p := filepath.Join(proc, name)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if err := BindMount(p, p, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC); err != nil {
			return fmt.Errorf("read-only /proc/%s: %w", name, err)
		}
	}
	return nil
}

// OverlayMount mounts at dst a read-only overlay of its own over the
// directory src (empty, an empty directory, the second layer an overlay
// without an upper one needs): the same files as a bind, but inodes of
// its own, so that an inotify watch on them sees only the opens made
// through this mount. The layers are given as detached mounts, so that
// mountinfo names no path of the host's. An error wrapping EINVAL is a
// kernel that cannot (layers by descriptor came with Linux 6.13): the
// caller binds instead.
func OverlayMount(src, empty, dst string, attrs uint64) error {
	var lowers []int
	defer func() {
		for _, fd := range lowers {
			unix.Close(fd)
		}
	}()
	for _, p := range []string{src, empty} {
		// A detached clone of the layer's mount: mountinfo then shows the
		// layer as "/" of it, not as its path on the host.
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("overlay of %s: open_tree: %w", src, err)
		}
		lowers = append(lowers, fd)
	}
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("overlay of %s: fsopen: %w", src, err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", "cage"); err != nil {
		return fmt.Errorf("overlay of %s: %w", src, err)
	}
	for _, fd := range lowers { // "lowerdir+" appends below: top first
		if err := unix.FsconfigSetFd(fsfd, "lowerdir+", fd); err != nil {
			return fmt.Errorf("overlay of %s: a layer by descriptor: %w", src, err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("overlay of %s: %w", src, err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, int(attrs|unix.MOUNT_ATTR_RDONLY))
	if err != nil {
		return fmt.Errorf("overlay of %s: fsmount: %w", src, err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("overlay of %s on %s: %w", src, dst, err)
	}
	return nil
}

// EmptyLower mounts a tiny tmpfs of its own on at (a directory it makes)
// holding an empty directory, the second layer OverlayMount's overlays
// take, and returns that directory and what detaches the tmpfs again and
// removes at: an overlay keeps its layers, so done follows the last
// overlay made, and nothing else ever sees the tmpfs. The caller's mount
// namespace is one whose mounts reach no other (a sandbox's, or a
// runtime's own; see the runc wall).
func EmptyLower(at string) (dir string, done func(), err error) {
	if err := os.Mkdir(at, 0o700); err != nil {
		return "", nil, err
	}
	if err := unix.Mount("tmpfs", at, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k,nr_inodes=4,mode=700"); err != nil {
		_ = os.Remove(at)
		return "", nil, fmt.Errorf("mount the overlays' empty layer: %w", err)
	}
	dir = filepath.Join(at, "empty")
	if err := os.Mkdir(dir, 0o555); err != nil {
		_ = unix.Unmount(at, unix.MNT_DETACH)
		_ = os.Remove(at)
		return "", nil, err
	}
	return dir, func() {
		_ = unix.Unmount(at, unix.MNT_DETACH)
		_ = os.Remove(at)
	}, nil
}

// ReadOnlyDir mounts at dst a template's directory src, read-only with
// attrs: a read-only overlay of its own (OverlayMount, empty from
// EmptyLower its second layer), whose inodes are its own, so that an
// inotify watch in the sandbox sees its own opens only, not the host's or
// another sandbox's of the same files (a bind shares the inodes: a watch
// on /usr/bin saw which programs the host and the other sandboxes ran). A
// kernel that cannot mount one so (before Linux 6.13) gets the bind.
func ReadOnlyDir(src, empty, dst string, attrs uint64) error {
	err := OverlayMount(src, empty, dst, attrs)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.ENODEV) {
		return err
	}
	return BindMount(src, dst, attrs|unix.MOUNT_ATTR_RDONLY)
}
