package seal

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Privileges. The agent keeps only the capabilities it needs to
// run commands as other users and to manage files for them. Commands are
// forked from one thread whose bounding set is shrunk to the same, so nothing
// they run can regain the rest, and whose securebits include SECBIT_NOROOT
// (locked): executing a program as uid 0 grants no capabilities, so a command
// run as root inside the sandbox has none, and one run as `user` loses them
// at setuid. Credentials are per thread; changes that every thread needs go
// through AllThreadsSyscall, which stops the world each time, so they are few.
var agentCaps = []uintptr{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_DAC_READ_SEARCH, unix.CAP_FOWNER,
	unix.CAP_FSETID, unix.CAP_KILL, unix.CAP_SETGID, unix.CAP_SETUID,
}

// sentinelCap is held (permitted, never effective) by the agent, where it
// can hold it, and by nothing it runs: no bounding set of a command has it. The kernel lets a
// process of the agent's uid ptrace the agent, or open its /proc/PID/mem,
// only if its capabilities include every one the agent holds; in a build
// sandbox, root's commands keep agentCaps (CAP_SETUID among them), so one
// could take the agent's uid with the same capabilities and write the
// agent's memory. The sentinel keeps the agent's set out of their reach.
// CAP_BLOCK_SUSPEND is checked only against the host's user namespace, so
// in the sandbox's it grants the agent nothing.
const sentinelCap = unix.CAP_BLOCK_SUSPEND

// Securebits (linux/securebits.h).
const (
	secbitNoroot               = 1 << 0
	secbitNorootLocked         = 1 << 1
	secbitNoAmbientRaise       = 1 << 6
	secbitNoAmbientRaiseLocked = 1 << 7
)

func allThreads(trap, a1, a2, a3 uintptr) error {
	if _, _, errno := syscall.AllThreadsSyscall(trap, a1, a2, a3); errno != 0 {
		return errno
	}
	return nil
}

// spawnThreadSetup runs on the agent's spawning thread (the one thread that
// forks commands): the bounding set and securebits are per thread, and
// commands inherit them from it. The bounding set is emptied: the thread
// keeps the capabilities it holds (a forked child still switches to the
// command's uid with them), but nothing it executes can gain any, root or
// not. SECBIT_NOROOT (locked) says the same a second time where the kernel
// allows it (gVisor refuses securebits; the empty bounding set still holds).
// It needs CAP_SETPCAP, so it runs before dropPrivileges.
func spawnThreadSetup() error {
	last, err := lastCap()
	if err != nil {
		return err
	}
	bits := uintptr(secbitNoroot | secbitNorootLocked | secbitNoAmbientRaise | secbitNoAmbientRaiseLocked)
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, bits, 0, 0, 0); err != nil && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("securebits: %w", err)
	}
	for c := uintptr(0); c <= last; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, c, 0, 0, 0); err != nil {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	return nil
}

// spawnThreadSetupBuild shrinks the spawning thread's bounding set to
// agentCaps and leaves SECBIT_NOROOT unset: a command executed as uid 0
// gets agentCaps (no_new_privs keeps it from more), one run as another uid
// none.
func spawnThreadSetupBuild() error {
	last, err := lastCap()
	if err != nil {
		return err
	}
	bits := uintptr(secbitNoAmbientRaise | secbitNoAmbientRaiseLocked)
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, bits, 0, 0, 0); err != nil && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("securebits: %w", err)
	}
	keep := map[uintptr]bool{}
	for _, c := range agentCaps {
		keep[c] = true
	}
	for c := uintptr(0); c <= last; c++ {
		if keep[c] {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, c, 0, 0, 0); err != nil {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	return nil
}

// dropPrivileges moves the agent to its own uid and gid (not root: root
// inside the sandbox holds no capabilities, and so can neither signal the
// agent nor touch its /proc files, which belong to the agent's uid), leaves
// every thread with only agentCaps, and sets no_new_privs.
func dropPrivileges(agentUID int) error {
	if err := allThreads(unix.SYS_PRCTL, unix.PR_SET_KEEPCAPS, 1, 0); err != nil {
		return fmt.Errorf("keep capabilities across setuid: %w", err)
	}
	// Supplementary groups are already empty: the host forked the agent
	// with Credential{0, 0}, which clears them.
	if err := allThreads(unix.SYS_SETRESGID, uintptr(agentUID), uintptr(agentUID), uintptr(agentUID)); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := allThreads(unix.SYS_SETRESUID, uintptr(agentUID), uintptr(agentUID), uintptr(agentUID)); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	for _, c := range agentCaps {
		data[c/32].Effective |= 1 << (c % 32)
		data[c/32].Permitted |= 1 << (c % 32)
	}
	// The sentinel where the agent holds it (it is root of its own user
	// namespace or guest); an OCI wall's runtime gives its init a short
	// list without it, and builds run on the process wall only.
	var held [2]unix.CapUserData
	if unix.Capget(&unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}, &held[0]) == nil &&
		held[sentinelCap/32].Permitted&(1<<(sentinelCap%32)) != 0 {
		data[sentinelCap/32].Permitted |= 1 << (sentinelCap % 32)
	}
	if err := allThreads(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	// Dumpable, so that /proc/1 belongs to the agent's uid rather than to
	// sandbox root; nothing else runs as that uid, so /proc/1/{mem,environ,
	// fd,oom_score_adj} stay closed to every process of the sandbox (but
	// while a command's fork changes its ids, which makes the memory it
	// shares with the agent undumpable until the agent sets it back after
	// the exec: docs/SECURITY.md, the spawner's window).
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("set dumpable: %w", err)
	}
	// no_new_privs: this thread now; seccomp's TSYNC gives it to the rest.
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

func lastCap() (uintptr, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("read cap_last_cap: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, err
	}
	return uintptr(n), nil
}
