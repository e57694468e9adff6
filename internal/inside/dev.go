package inside

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Child side: a minimal /dev. Device nodes cannot be created in a user
// namespace, so the few harmless ones are bound from the host's /dev; the
// tmpfs under them is nodev, so no other device can appear.
var devNodes = []string{"null", "zero", "full", "random", "urandom", "tty"}

// BuildDev makes root's minimal /dev: a small tmpfs, the harmless nodes
// bound from /dev, private PTYs and a /dev/shm of shm bytes. The microvm
// guest builds its sandbox's /dev with it too.
func BuildDev(root string, shmBytes int64) error {
	dev := filepath.Join(root, "dev")
	if err := os.Mkdir(dev, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "size=64k,nr_inodes=64,mode=755"); err != nil {
		return fmt.Errorf("mount /dev: %w", err)
	}
	for _, name := range devNodes {
		dst := filepath.Join(dev, name)
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o666)
		if err != nil {
			return err
		}
		f.Close()
		if err := BindMount(filepath.Join("/dev", name), dst, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NOEXEC); err != nil {
			return err
		}
	}
	// A devpts of its own, holding at most MaxPtys: the kernel's count of
	// ptys (kernel.pty.max) is the host's, shared by every instance.
	pts := filepath.Join(dev, "pts")
	if err := os.Mkdir(pts, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("devpts", pts, "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5,max="+strconv.Itoa(MaxPtys)); err != nil {
		return fmt.Errorf("mount /dev/pts: %w", err)
	}
	shm := filepath.Join(dev, "shm")
	if err := os.Mkdir(shm, os.ModeSticky|0o777); err != nil {
		return err
	}
	opts := "mode=1777,size=" + strconv.FormatInt(shmBytes, 10)
	if err := unix.Mount("tmpfs", shm, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return fmt.Errorf("mount /dev/shm: %w", err)
	}
	links := map[string]string{
		"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2", "core": "/proc/kcore",
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil {
			return err
		}
	}
	return nil
}

// MaxPtys is how many ptys a sandbox's devpts holds at most (its
// terminals, E2B's PTY sessions): kernel.pty.max is shared by every
// sandbox and the host (see sandbox.HostLimits).
const MaxPtys = 256
