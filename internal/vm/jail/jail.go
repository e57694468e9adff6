// Package jail is the jailer of QEMU: cage-agent's `qemu-jail` mode, root in
// QEMU's new namespaces, which builds QEMU's root, drops to its credential
// and execs it. The host (package vm) starts it with Command.
package jail

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
)

// A QEMU that a guest escapes into must find nothing of the host around
// it: QEMU runs in network, mount, PID, IPC and UTS namespaces of its own.
// The network namespace is empty (its NIC is a tap descriptor it is
// handed). The mount namespace holds a read-only tmpfs root with the
// host's /usr (QEMU, its libraries and firmware; the /lib* and /bin links
// or binds a merged or split /usr needs), a /dev of null, zero, random,
// urandom and (under KVM) kvm, and a /proc of QEMU's own PID namespace,
// through which it names the files it inherits (/proc/self/fd/N). No host
// path it could write is there: its sockets and console are descriptors.
//
// Namespaces are made by clone; the mounts need a process inside them
// before QEMU: the jailer, cage-agent's `qemu-jail` mode (Arg), which
// builds the root, drops to QEMU's credential and execs QEMU.

// Arg is cage-agent's argument that makes it the jailer:
// `cage-agent qemu-jail SPEC QEMU ARGS...`.
const Arg = "qemu-jail"

// Spec is what the jailer is told (as JSON, its first argument).
type Spec struct {
	UID      uint32   `json:"uid"`
	GID      uint32   `json:"gid"`
	Groups   []uint32 `json:"groups"`
	KVM      bool     `json:"kvm,omitempty"`
	Lifeline int      `json:"lifeline"` // read end of a pipe the host holds the other end of
	// FileBytes bounds every regular file QEMU writes (RLIMIT_FSIZE, soft
	// and hard): the files it is handed (a snapshot's RAM and state, a
	// checkpoint) are the only ones it can write, and the largest an
	// honest QEMU writes is its VM's RAM and a margin (vm.FileBound).
	// Required: a jail without it is refused.
	FileBytes int64 `json:"file_bytes"`
}

// Flags are the namespaces QEMU gets.
const Flags = syscall.CLONE_NEWNS | syscall.CLONE_NEWNET | syscall.CLONE_NEWPID |
	syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS

// Main is the jailer (cage-agent qemu-jail SPEC QEMU ARGS...), root in
// QEMU's new namespaces: it builds QEMU's root, becomes QEMU's uid and
// execs QEMU. It returns only on error.
func Main(args []string) error {
	if len(args) < 2 {
		return errors.New("usage: qemu-jail SPEC QEMU [ARGS...]")
	}
	var spec Spec
	if err := json.Unmarshal([]byte(args[0]), &spec); err != nil {
		return fmt.Errorf("jail spec: %w", err)
	}
	if spec.FileBytes <= 0 {
		return errors.New("jail spec: no bound on the files QEMU writes")
	}
	// The parent-death signal and the exec below belong to this thread.
	runtime.LockOSThread()
	unix.CloseOnExec(spec.Lifeline)
	// QEMU gets the descriptors it was given (the lifeline is the last
	// of them), nothing a fork of the host's happened to inherit (a
	// descriptor made without close-on-exec somewhere in the daemon, as
	// a volume's root once was): the rest close at the exec.
	if err := unix.CloseRange(uint(spec.Lifeline)+1, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("jail: close-on-exec: %w", err)
	}
	// A session keyring of its own, empty: QEMU would otherwise possess
	// the daemon's (read its keys, add and revoke them, and pass keys to
	// every other VM through it).
	if _, _, e := unix.RawSyscall(unix.SYS_KEYCTL, unix.KEYCTL_JOIN_SESSION_KEYRING, 0, 0); e != 0 {
		return fmt.Errorf("jail: a session keyring of its own: %w", e)
	}
	if err := boundFiles(spec.FileBytes); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	// No core dump (inside.LimitCoreDumps): a guest that makes QEMU
	// abort would otherwise have a pipe core_pattern's helper (systemd-
	// coredump, apport) run on the host, as root and outside the
	// sandbox's cgroups, and read QEMU's memory, the VM's RAM, into the
	// host's crash store. QEMU, an unprivileged uid, cannot raise it.
	if err := inside.LimitCoreDumps(); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := buildJail(spec.KVM); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := syscall.Setgroups(intIDs(spec.Groups)); err != nil {
		return fmt.Errorf("jail: setgroups: %w", err)
	}
	if err := syscall.Setgid(int(spec.GID)); err != nil {
		return fmt.Errorf("jail: setgid: %w", err)
	}
	if err := syscall.Setuid(int(spec.UID)); err != nil {
		return fmt.Errorf("jail: setuid: %w", err)
	}
	// A change of uid cleared the parent-death signal: arm it again, then
	// make sure the parent did not die before (its end of the lifeline
	// closes with it).
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := hostThere(spec.Lifeline); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	return syscall.Exec(args[1], args[1:], []string{})
}

// hostThere says whether the host still holds the write end of the
// lifeline (read end fd): it never writes to it, so the pipe is neither
// readable nor hung up while the host lives. A signal that arrives during
// the poll (the Go runtime's own preemption signal, sent to a thread that
// ran long, as under load) fails it with EINTR, which says nothing of the
// host: it is asked again. It was read as the host's going, and a VM
// failed to start now and then on a loaded host with "the host went
// away".
func hostThere(fd int) error {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return fmt.Errorf("poll the lifeline: %w", err)
		case n == 0:
			return nil
		case fds[0].Revents&unix.POLLNVAL != 0:
			return fmt.Errorf("the lifeline (descriptor %d) is not open", fd)
		case fds[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0:
			return errors.New("the host went away")
		default:
			return errors.New("the host went away (its end of the lifeline was written to)")
		}
	}
}

// boundFiles holds every regular file QEMU writes to n bytes: a write or
// a truncate past it fails with EFBIG. The kernel also sends SIGXFSZ,
// which would end QEMU; it is ignored here, and an ignored signal stays
// ignored across the exec, so an honest QEMU sees the error (a checkpoint
// past its bound fails as a full disk does, and the VM runs on) rather
// than dying. QEMU, an unprivileged uid, cannot raise the hard limit.
func boundFiles(n int64) error {
	lim := unix.Rlimit{Cur: uint64(n), Max: uint64(n)}
	if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &lim); err != nil {
		return fmt.Errorf("bound the files QEMU writes: %w", err)
	}
	signal.Ignore(unix.SIGXFSZ)
	return nil
}

func intIDs(ids []uint32) []int {
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = int(id)
	}
	return out
}

// jailRoot is where the jail's root is built, in the jailer's private
// mount namespace (the host's /tmp is untouched).
const jailRoot = "/tmp"

// buildJail makes QEMU's root and pivots into it.
func buildJail(kvm bool) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", jailRoot, "tmpfs", unix.MS_NOSUID, "size=64k,nr_inodes=64,mode=755"); err != nil {
		return err
	}
	for _, d := range []string{"usr", "dev", "proc"} {
		if err := os.Mkdir(filepath.Join(jailRoot, d), 0o755); err != nil {
			return err
		}
	}
	if err := bindRO("/usr", filepath.Join(jailRoot, "usr"), unix.MS_NODEV); err != nil {
		return err
	}
	// The top-level directories the loader and QEMU's paths may go
	// through: links into /usr where the host has them, binds otherwise.
	for _, d := range []string{"bin", "sbin", "lib", "lib64", "lib32", "libx32"} {
		if err := copyTop(d); err != nil {
			return err
		}
	}
	if err := jailDev(kvm); err != nil {
		return err
	}
	if err := unix.Mount("proc", filepath.Join(jailRoot, "proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if err := unix.Chdir(jailRoot); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host's tree: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	return unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID, "")
}

// copyTop gives the jail the host's top-level /name as the host has it: a
// symlink (merged /usr) or a read-only bind.
func copyTop(name string) error {
	src, dst := "/"+name, filepath.Join(jailRoot, name)
	fi, err := os.Lstat(src)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		return os.Symlink(target, dst)
	}
	if !fi.IsDir() {
		return nil
	}
	if err := os.Mkdir(dst, 0o755); err != nil {
		return err
	}
	return bindRO(src, dst, unix.MS_NODEV)
}

// jailDev makes the jail's /dev: the harmless nodes QEMU may open, and
// /dev/kvm under KVM, bound from the host's.
func jailDev(kvm bool) error {
	dev := filepath.Join(jailRoot, "dev")
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "size=4k,nr_inodes=16,mode=755"); err != nil {
		return err
	}
	nodes := []string{"null", "zero", "random", "urandom"}
	if kvm {
		nodes = append(nodes, "kvm")
	}
	for _, n := range nodes {
		dst := filepath.Join(dev, n)
		if err := os.WriteFile(dst, nil, 0o600); err != nil {
			return err
		}
		if err := bindRO("/dev/"+n, dst, 0); err != nil {
			return err
		}
	}
	return unix.Mount("", dev, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, "size=4k,nr_inodes=16,mode=755")
}

// bindRO binds src on dst, read-only and nosuid (plus extra flags).
func bindRO(src, dst string, extra uintptr) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	flags := unix.MS_REMOUNT | unix.MS_BIND | unix.MS_RDONLY | unix.MS_NOSUID | extra
	if err := unix.Mount("", dst, "", flags, ""); err != nil {
		return fmt.Errorf("bind %s read-only: %w", src, err)
	}
	// The remount covers the top mount only: the host's mounts under src
	// (a writable /usr/local, say) are made read-only (and nosuid, nodev
	// where asked) too.
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID}
	if extra&unix.MS_NODEV != 0 {
		attr.Attr_set |= unix.MOUNT_ATTR_NODEV
	}
	if err := unix.MountSetattr(unix.AT_FDCWD, dst, unix.AT_RECURSIVE, attr); err != nil {
		return fmt.Errorf("bind %s read-only, under it too: %w", src, err)
	}
	return nil
}
