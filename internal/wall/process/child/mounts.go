package child

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/trace"
)

// Child side: assemble the sandbox's root on spec.Root inside the new mount
// namespace, then pivot_root into it. Nothing here is visible to the host:
// propagation is private, and the namespace dies with the sandbox.

func buildRoot(spec *InitSpec) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	root := spec.Root
	if spec.Image != "" {
		// An image template: the host mounted its overlay, whose upper
		// layer is the sandbox's disk.
		if err := attachRoot(root); err != nil {
			return err
		}
		trace.Mark("root: image")
		if err := inside.PrepareImageRoot(root, spec.Hostname, func(id int) int { return id }, spec.Build); err != nil {
			return err
		}
	} else {
		if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=2m,nr_inodes=4096,mode=755"); err != nil {
			return fmt.Errorf("mount root tmpfs: %w", err)
		}
		trace.Mark("root: mounts")
		empty, done, err := inside.EmptyLower(filepath.Join(root, ".cage-lower"))
		if err != nil {
			return err
		}
		for _, m := range spec.Mounts {
			if err := placeMount(root, m, empty); err != nil {
				done()
				return err
			}
		}
		done()
		trace.Mark("root: etc")
		if err := writeIdentity(root, spec); err != nil {
			return err
		}
		trace.Mark("root: disk")
		if err := mountDisk(root, spec); err != nil {
			return err
		}
	}
	if len(spec.Volumes) > 0 {
		trace.Mark("root: volumes")
		if err := mountVolumes(root, spec.Volumes); err != nil {
			return err
		}
	}
	if spec.Image != "" || len(spec.Volumes) > 0 {
		unix.Close(fdRoot) // everything the host sends on it has come
	}
	trace.Mark("root: dev")
	if err := inside.BuildDev(root, spec.ShmBytes); err != nil {
		return err
	}
	trace.Mark("root: proc")
	if err := inside.MountProc(root, inside.LimitSocketMemory); err != nil {
		return err
	}
	trace.Mark("root: done")
	if spec.Image != "" {
		return nil // the image has its own directories
	}
	for _, d := range []string{"run", "mnt", "opt", "srv", "var"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// placeMount brings one template entry into the new root: a directory
// as a read-only overlay of its own over the host's (inside.ReadOnlyDir,
// empty its second layer), a file as a read-only bind.
func placeMount(root string, m inside.Mount, empty string) error {
	dst := filepath.Join(root, m.Dest)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	switch m.Kind {
	case inside.Symlink:
		return os.Symlink(m.Target, dst)
	case inside.Dir:
		if err := os.Mkdir(dst, 0o755); err != nil && !os.IsExist(err) {
			return err
		}
	case inside.File:
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		f.Close()
	default:
		return fmt.Errorf("template entry %s: unknown kind %q", m.Dest, m.Kind)
	}
	if m.Kind == inside.Dir {
		if err := inside.ReadOnlyDir(m.Source, empty, dst, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV); err != nil {
			return fmt.Errorf("template entry %s: %w", m.Dest, err)
		}
		return nil
	}
	return inside.BindMount(m.Source, dst, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
}

// mountDisk makes the sandbox's writable storage: one size- and inode-limited
// tmpfs whose directories appear as /tmp, /var/tmp, /home and /root, so that
// the limit covers them together.
func mountDisk(root string, spec *InitSpec) error {
	stage := filepath.Join(root, ".disk")
	if err := os.Mkdir(stage, 0o700); err != nil {
		return err
	}
	opts := "mode=755,size=" + strconv.FormatInt(spec.DiskBytes, 10) + ",nr_inodes=" + strconv.FormatInt(spec.DiskInodes, 10)
	if err := unix.Mount("tmpfs", stage, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount disk tmpfs: %w", err)
	}
	home := filepath.Join(stage, "home", spec.UserName)
	dirs := []struct {
		path string
		mode os.FileMode
	}{{filepath.Join(stage, "tmp"), os.ModeSticky | 0o777}, {filepath.Join(stage, "vartmp"), os.ModeSticky | 0o777},
		{filepath.Join(stage, "home"), 0o755}, {home, 0o750}, {filepath.Join(stage, "root"), 0o700}}
	for _, d := range dirs {
		if err := os.Mkdir(d.path, d.mode); err != nil {
			return err
		}
		if err := os.Chmod(d.path, d.mode); err != nil { // umask
			return err
		}
	}
	if err := os.Chown(home, spec.UserUID, spec.UserGID); err != nil {
		return err
	}
	for src, dst := range map[string]string{"tmp": "tmp", "vartmp": "var/tmp", "home": "home", "root": "root"} {
		target := filepath.Join(root, dst)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		if err := inside.BindMount(filepath.Join(stage, src), target, 0); err != nil {
			return err
		}
	}
	if err := unix.Unmount(stage, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount disk stage: %w", err)
	}
	return os.Remove(stage)
}

// pivot makes root the process's root and detaches the host's tree.
func pivot(root string, writable bool) error {
	if err := unix.Chdir(root); err != nil {
		return err
	}
	// pivot_root(".", ".") stacks the old root on top of the new one; the
	// detach below then removes it, without needing a directory for it.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host's root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if writable {
		return nil
	}
	// The root tmpfs becomes read-only; /tmp, /home, /dev/shm stay writable.
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
	if err := unix.MountSetattr(unix.AT_FDCWD, "/", 0, attr); err != nil {
		return fmt.Errorf("read-only root: %w", err)
	}
	return nil
}

// attachRoot receives the detached copy of the image's root mount that the
// host sends on fdRoot and attaches it at root (it is nosuid and nodev
// already: the host mounted it so).
func attachRoot(root string) error {
	fd, err := receiveMount("the image's root")
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the image's root: %w", err)
	}
	return nil
}

// receiveMount receives one detached mount the host sends on fdRoot.
func receiveMount(what string) (int, error) {
	buf, oob := make([]byte, 16), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(fdRoot, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("receive %s: %w", what, err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return -1, fmt.Errorf("receive %s: no descriptor", what)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("receive %s: no descriptor", what)
	}
	return fds[0], nil
}

// mountVolumes attaches the volumes the host sends on fdRoot (detached
// copies of their mounts, idmapped onto the sandbox's ids, nosuid and
// nodev) at their paths in root. The directories on the way are made or
// entered one at a time without following any symlink: an image's files
// are not trusted, and before pivot_root an absolute link would name the
// host's tree.
func mountVolumes(root string, paths []string) error {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(rfd)
	for _, p := range paths {
		at, err := mkdirsBeneath(rfd, p)
		if err != nil {
			return fmt.Errorf("volume mount point %s: %w", p, err)
		}
		fd, err := receiveMount("the volume at " + p)
		if err == nil {
			err = unix.MoveMount(fd, "", at, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
			unix.Close(fd)
		}
		unix.Close(at)
		if err != nil {
			return fmt.Errorf("attach the volume at %s: %w", p, err)
		}
	}
	return nil
}

// mkdirsBeneath opens the directory p under dirfd, making what is missing
// (0755), following no symlink.
func mkdirsBeneath(dirfd int, p string) (int, error) {
	cur, err := unix.FcntlInt(uintptr(dirfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	for _, c := range strings.Split(strings.Trim(p, "/"), "/") {
		if err := unix.Mkdirat(cur, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			unix.Close(cur)
			return -1, err
		}
		next, err := unix.Openat2(cur, c, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}
