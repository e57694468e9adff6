package guest

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/vm/boot"
)

// The guest runs two processes of cage-agent. The guest's init (PID 1 of
// the guest, started by the kernel with no arguments) mounts the guest's
// /dev, /proc and /sys, loads the modules, opens the agent port and starts
// the agent as PID 1 of a PID namespace of its own (guestAgentArg), as on
// the other walls: a sandbox's processes see their own and nothing of the
// guest kernel's threads or its init. The init then only reaps, and powers
// the guest off when the agent ends. The agent is started once per boot,
// before any snapshot, so a restored guest pays nothing for it.

// guestAgentArg is the agent's argument in the guest: `cage-agent guest`.
const guestAgentArg = "guest"

// portFD is the agent port's descriptor in the guest's agent; clockFD its
// end of the socket to the init (see serveClock).
const (
	portFD  = 3
	clockFD = 4
)

// IsGuestInit reports whether this process is a microvm guest's init (PID
// 1, started by the kernel without arguments) or its agent (PID 1 of the
// sandbox's PID namespace, `cage-agent guest`).
func IsGuestInit() bool {
	return os.Getpid() == 1 && (len(os.Args) == 1 || (len(os.Args) == 2 && os.Args[1] == guestAgentArg))
}

// GuestServe is the guest's init or its agent (see IsGuestInit). It
// returns only on error or, for the init, once the agent has ended (the
// caller then powers the guest off).
func GuestServe() error {
	if len(os.Args) == 2 {
		port := os.NewFile(portFD, "agent-port")
		// Nothing inherited reaches the commands: the port and anything
		// else the init handed down are closed on exec.
		if err := unix.CloseRange(portFD, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC); err != nil {
			return fmt.Errorf("close-on-exec: %w", err)
		}
		return guestAgent(port)
	}
	port, err := boot.GuestSetup()
	if err != nil {
		return err
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("the clock's socket: %w", err)
	}
	pid, err := startGuestAgent(port, pair[1])
	port.Close()
	unix.Close(pair[1])
	if err != nil {
		return err
	}
	go serveClock(pair[0])
	return reapUntil(pid)
}

// serveClock is the init's service to its agent, which cannot do it once
// sealed: for each resume (see Spec) it sets the clock, mixes random
// bytes in and forgets the neighbours, and answers "ok" or the error. Only the agent holds the
// other end.
func serveClock(fd int) {
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n == 0 {
			return
		}
		var sp Spec
		answer := "ok"
		if err := json.Unmarshal(buf[:n], &sp); err != nil {
			answer = err.Error()
		} else if err := setClock(sp); err != nil {
			answer = err.Error()
		} else {
			forgetNeighbours()
		}
		_, _ = unix.Write(fd, []byte(answer))
	}
}

// forgetNeighbours empties the guest's neighbour table: a resumed guest's
// NIC is spliced to a new interface on the host, whose address (the
// gateway's) is the same but whose MAC is not.
func forgetNeighbours() {
	neighs, err := netlink.NeighList(0, netlink.FAMILY_ALL)
	if err != nil {
		return
	}
	for i := range neighs {
		_ = netlink.NeighDel(&neighs[i])
	}
}

// resumed has the init set the clock and add the random bytes of a
// resume's spec (see serveClock).
func resumed(sp Spec) error {
	b, err := json.Marshal(Spec{Resume: true, Entropy: sp.Entropy, UnixNano: sp.UnixNano})
	if err != nil {
		return err
	}
	if _, err := unix.Write(clockFD, b); err != nil {
		return fmt.Errorf("ask the init for the clock: %w", err)
	}
	buf := make([]byte, 512)
	n, err := unix.Read(clockFD, buf)
	if err != nil {
		return fmt.Errorf("ask the init for the clock: %w", err)
	}
	if got := string(buf[:n]); got != "ok" {
		return fmt.Errorf("the init: %s", got)
	}
	return nil
}

// startGuestAgent starts `cage-agent guest` (this binary, the initramfs's
// /init) as PID 1 of a new PID namespace, with the port as its fd 3 and
// its end of the clock's socket as fd 4.
func startGuestAgent(port *os.File, clock int) (int, error) {
	pid, err := syscall.ForkExec("/init", []string{"cage-agent", guestAgentArg}, &syscall.ProcAttr{
		Dir:   "/",
		Env:   []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Files: []uintptr{0, 1, 2, port.Fd(), uintptr(clock)},
		Sys:   &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID},
	})
	if err != nil {
		return 0, fmt.Errorf("start the guest's agent: %w", err)
	}
	return pid, nil
}

// reapUntil reaps every child of the init (orphans the kernel gives it)
// until the agent, pid, has ended, and says how it did.
func reapUntil(pid int) error {
	for {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("wait for the guest's agent: %w", err)
		}
		if got != pid {
			continue
		}
		if ws.Signaled() {
			return fmt.Errorf("the guest's agent was killed (%v)", ws.Signal())
		}
		return fmt.Errorf("the guest's agent exited (status %d)", ws.ExitStatus())
	}
}
