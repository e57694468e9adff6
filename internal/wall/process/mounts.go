package process

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/trace"
)

// Child side: assemble the sandbox's root on spec.Root inside the new mount
// namespace, then pivot_root into it. Nothing here is visible to the host:
// propagation is private, and the namespace dies with the sandbox.

// Paths of /proc that are hidden (files: /dev/null bound over them; dirs: an
// empty read-only tmpfs) or made read-only, as container runtimes do.
var (
	procMasked   = []string{"kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms", "acpi", "scsi", "asound", "firmware", "interrupts", "kpagecount", "kpageflags", "kpagecgroup", "vmallocinfo"}
	procReadOnly = []string{"bus", "fs", "irq", "sys", "sysrq-trigger"}
)

func buildRoot(spec *initSpec) error {
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
		if err := template.PrepareImageRoot(root, spec.Hostname, func(id int) int { return id }, spec.Build); err != nil {
			return err
		}
	} else {
		if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=2m,nr_inodes=4096,mode=755"); err != nil {
			return fmt.Errorf("mount root tmpfs: %w", err)
		}
		trace.Mark("root: mounts")
		for _, m := range spec.Mounts {
			if err := placeMount(root, m); err != nil {
				return err
			}
		}
		trace.Mark("root: etc")
		if err := writeIdentity(root, spec); err != nil {
			return err
		}
		trace.Mark("root: disk")
		if err := mountDisk(root, spec); err != nil {
			return err
		}
	}
	trace.Mark("root: dev")
	if err := BuildDev(root, spec.ShmBytes); err != nil {
		return err
	}
	trace.Mark("root: proc")
	if err := MountProc(root); err != nil {
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

// placeMount brings one template entry into the new root.
func placeMount(root string, m template.Mount) error {
	dst := filepath.Join(root, m.Dest)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	switch m.Kind {
	case template.Symlink:
		return os.Symlink(m.Target, dst)
	case template.Dir:
		if err := os.Mkdir(dst, 0o755); err != nil && !os.IsExist(err) {
			return err
		}
	case template.File:
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		f.Close()
	default:
		return fmt.Errorf("template entry %s: unknown kind %q", m.Dest, m.Kind)
	}
	return bindMount(m.Source, dst, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
}

// bindMount clones the mount tree at src onto dst with extra attributes set
// on every mount of the tree (a recursive read-only bind that also covers
// submounts, which a classic MS_BIND remount does not).
func bindMount(src, dst string, attrs uint64) error {
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

// setAttr sets mount attributes on the mount at path (recursively).
func setAttr(path string, attrs uint64) error {
	attr := &unix.MountAttr{Attr_set: attrs}
	if err := unix.MountSetattr(unix.AT_FDCWD, path, unix.AT_RECURSIVE, attr); err != nil {
		return fmt.Errorf("mount_setattr %s: %w", path, err)
	}
	return nil
}

// mountDisk makes the sandbox's writable storage: one size- and inode-limited
// tmpfs whose directories appear as /tmp, /var/tmp, /home and /root, so that
// the limit covers them together.
func mountDisk(root string, spec *initSpec) error {
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
		if err := bindMount(filepath.Join(stage, src), target, 0); err != nil {
			return err
		}
	}
	if err := unix.Unmount(stage, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount disk stage: %w", err)
	}
	return os.Remove(stage)
}

// MountProc mounts a fresh /proc for the sandbox's PID namespace and masks
// the paths that reveal or touch the host kernel (the microvm guest's
// sandbox gets the same, for its own kernel).
func MountProc(root string) error {
	proc := filepath.Join(root, "proc")
	if err := os.Mkdir(proc, 0o555); err != nil && !os.IsExist(err) {
		return err
	}
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
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
			err = bindMount("/dev/null", p, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NOEXEC)
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
		if err := bindMount(p, p, unix.MOUNT_ATTR_RDONLY|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC); err != nil {
			return fmt.Errorf("read-only /proc/%s: %w", name, err)
		}
	}
	return nil
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
	buf, oob := make([]byte, 16), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(fdRoot, buf, oob, unix.MSG_CMSG_CLOEXEC)
	unix.Close(fdRoot)
	if err != nil {
		return fmt.Errorf("receive the image's root: %w", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return fmt.Errorf("receive the image's root: no descriptor")
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return fmt.Errorf("receive the image's root: no descriptor")
	}
	defer unix.Close(fds[0])
	if err := unix.MoveMount(fds[0], "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the image's root: %w", err)
	}
	return nil
}
