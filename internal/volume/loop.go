package volume

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// A volume's bytes are one sparse file, DATA/volumes/ID/volume.img, holding
// an ext4 file system of the volume's size: the size is its quota (a full
// volume is ENOSPC inside every sandbox that mounts it, and 507 through the
// content API), its blocks are allocated on the host only as they are
// written, and the file system's structures are written by the host's
// kernel alone (no sandbox ever sees the image, only files in it). The
// image is attached to a loop device and mounted on the host once, at
// RUN/volumes/ID (a directory only root can traverse); sandboxes and the
// content API take that mount.

// makeImage creates the image file of size bytes and its file system,
// whose root belongs to the sandboxes' user (uid and gid 1000), 0755.
func makeImage(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	mkfs, err := findMkfs()
	if err != nil {
		return err
	}
	// -m 0: no blocks kept back for root (the size is the user's);
	// lazy inits keep the sparse file small; the journal stays (a host
	// crash leaves a consistent file system).
	out, err := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-m", "0",
		"-E", fmt.Sprintf("root_owner=%d:%d,lazy_itable_init=1,lazy_journal_init=1", UserID, UserID), path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mke2fs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// findMkfs locates mke2fs (e2fsprogs), on the PATH or where Debian keeps it.
func findMkfs() (string, error) {
	if p, err := exec.LookPath("mke2fs"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/mke2fs", "/sbin/mke2fs"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: volumes need mke2fs (apt-get install e2fsprogs)", ErrUnavailable)
}

// mountImage mounts the image at dir: on the loop device that already
// holds it, if one does (a sandbox of an earlier daemon may still have the
// file system mounted: a second loop device would make a second,
// conflicting file system of the same bytes; the same device shares the
// kernel's one), else on a new one that the kernel detaches when the last
// mount of it goes.
func mountImage(image, dir string) error {
	img, err := os.OpenFile(image, os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer img.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(img.Fd()), &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("volume image %s is not a regular file", image)
	}
	dev := findLoop(uint64(st.Dev), st.Ino)
	if dev == "" {
		fd, name, err := attachLoop(img)
		if err != nil {
			return err
		}
		// An auto-clearing device is detached when nothing holds it: the
		// descriptor holds it until the mount does.
		defer unix.Close(fd)
		dev = name
	}
	return mountExt4(dev, dir)
}

// findLoop returns the loop device whose backing file is the inode ino of
// the device devNo, or "".
func findLoop(devNo, ino uint64) string {
	ents, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, e := range ents {
		name := filepath.Base(filepath.Dir(filepath.Dir(e)))
		fd, err := unix.Open("/dev/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		info, err := unix.IoctlLoopGetStatus64(fd)
		unix.Close(fd)
		if err == nil && info.Device == devNo && info.Inode == ino {
			return "/dev/" + name
		}
	}
	return ""
}

// attachLoop attaches img to a free loop device, auto-clearing: it goes
// when the last holder of it (the returned descriptor, then the mounts)
// does. The caller closes the descriptor once it has mounted the device.
func attachLoop(img *os.File) (int, string, error) {
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, "", fmt.Errorf("%w: volumes need loop devices: %v", ErrUnavailable, err)
	}
	defer unix.Close(ctl)
	for attempt := 0; attempt < 16; attempt++ {
		n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return -1, "", fmt.Errorf("%w: no free loop device: %v", ErrUnavailable, err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, "", fmt.Errorf("%s: %w", dev, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(img.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		err = unix.IoctlLoopConfigure(fd, &cfg)
		if errors.Is(err, unix.EBUSY) {
			unix.Close(fd)
			continue // another process took it between the two calls
		}
		if err != nil {
			unix.Close(fd)
			return -1, "", fmt.Errorf("attach %s: %w", dev, err)
		}
		return fd, dev, nil
	}
	return -1, "", fmt.Errorf("%w: no loop device stayed free", ErrUnavailable)
}

// mountExt4 mounts the ext4 file system on dev at dir: nosuid and nodev
// (a device node or setuid file planted in a volume is inert on the host
// and in every sandbox's copy of the mount).
func mountExt4(dev, dir string) error {
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen ext4: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev); err != nil {
		return fmt.Errorf("volume source %s: %w", dev, err)
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("mount the volume's file system (%s): %w", dev, err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fmt.Errorf("mount the volume: %w", err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the volume at %s: %w", dir, err)
	}
	return nil
}

// unmount detaches what is mounted at dir (a volume's host mount), through
// a descriptor of its root.
func unmount(dir string) error {
	for i := 0; i < 16 && isMountRoot(dir); i++ {
		fd, err := unix.Open(dir, unix.O_PATH|unix.O_NOFOLLOW|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		err = unix.Unmount("/proc/self/fd/"+strconv.Itoa(fd), unix.MNT_DETACH)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("detach the volume at %s: %w", dir, err)
		}
	}
	return nil // the loop device clears by itself once no mount holds it
}

// isMountRoot reports whether path (not followed) is the root of a mount.
func isMountRoot(path string) bool {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx)
	return err == nil && stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
}
