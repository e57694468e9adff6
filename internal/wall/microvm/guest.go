package microvm

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/seal"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall/process"
)

// IsGuestInit reports whether this process is the init of a microvm guest:
// PID 1, started by the kernel without arguments.
func IsGuestInit() bool { return os.Getpid() == 1 && len(os.Args) == 1 }

// GuestServe is the agent as the guest's init. It returns only on error
// (the caller then powers the guest off).
func GuestServe() error {
	port, err := vm.GuestSetup()
	if err != nil {
		return err
	}
	if _, err := port.WriteString(hello); err != nil {
		return fmt.Errorf("agent port: %w", err)
	}
	sess, err := yamux.Server(port, sessionConfig())
	if err != nil {
		return err
	}
	first, err := sess.Accept()
	if err != nil {
		return fmt.Errorf("wait for the spec: %w", err)
	}
	var sp spec
	if err := json.NewDecoder(bufio.NewReader(io.LimitReader(first, 1<<20))).Decode(&sp); err != nil {
		return fmt.Errorf("read the spec: %w", err)
	}
	if err := switchRoot(sp); err != nil {
		fmt.Fprintf(first, "error: %v\n", err)
		return err
	}
	if err := unix.Sethostname([]byte(sp.Hostname)); err != nil {
		return err
	}
	if err := process.LoopbackUp(); err != nil {
		return err
	}
	srv, err := agent.New(agent.Config{
		Token: sp.Token, DefaultUser: template.UserName, Env: sp.Env, MaxOutput: sp.MaxOutput,
		SpawnThreadSetup: seal.SpawnThread, AgentUID: template.AgentUID, Threads: sp.Threads,
	})
	if err != nil {
		return err
	}
	if _, err := seal.Seal(seal.Options{AgentUID: template.AgentUID, WritableRoot: true}); err != nil {
		return err
	}
	if _, err := io.WriteString(first, ready); err != nil {
		return err
	}
	first.Close()
	return srv.Serve(sess)
}

func sessionConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.LogOutput = io.Discard
	c.EnableKeepAlive = false // the port is a private wire; QEMU's exit ends it
	return c
}

// switchRoot mounts the template's image (/dev/vda, read-only) under an
// overlay whose upper layer is a tmpfs of the disk size, moves /dev, /proc
// and /sys into it and makes it the root (an initramfs cannot pivot_root:
// the new root is moved onto / and chrooted into, as switch_root does).
func switchRoot(sp spec) error {
	for _, d := range []string{"/lower", "/rw", "/newroot"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("/dev/vda", "/lower", "ext4", unix.MS_RDONLY|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount the template image: %w", err)
	}
	opts := "mode=755,size=" + strconv.FormatInt(sp.DiskBytes, 10)
	if err := unix.Mount("tmpfs", "/rw", "tmpfs", unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount the disk: %w", err)
	}
	for _, d := range []string{"/rw/upper", "/rw/work"} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("overlay", "/newroot", "overlay", unix.MS_NODEV,
		"lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work"); err != nil {
		return fmt.Errorf("mount the root overlay: %w", err)
	}
	if err := template.PrepareImageRoot("/newroot", sp.Hostname, func(id int) int { return id }, false); err != nil {
		return err
	}
	for _, m := range []string{"/dev", "/proc", "/sys"} {
		dst := filepath.Join("/newroot", m)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m, dst, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s: %w", m, err)
		}
	}
	if err := unix.Chdir("/newroot"); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	// PTYs and shared memory, as on every wall.
	if err := os.MkdirAll("/dev/pts", 0o755); err != nil {
		return err
	}
	if err := unix.Mount("devpts", "/dev/pts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5"); err != nil {
		return fmt.Errorf("mount /dev/pts: %w", err)
	}
	_ = os.Remove("/dev/ptmx")
	if err := os.Symlink("pts/ptmx", "/dev/ptmx"); err != nil {
		return err
	}
	if err := os.MkdirAll("/dev/shm", 0o1777); err != nil {
		return err
	}
	return unix.Mount("tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=1777,size=64m")
}

// PowerOff ends the guest (QEMU, started with -no-reboot, then exits).
func PowerOff() {
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
}
