package spawner

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// ForkOwned runs fork, which starts a process in a new user namespace
// (syscall.ForkExec with CLONE_NEWUSER and its id maps), from a thread whose
// effective uid and gid are uid and gid, so that the namespace is theirs:
// the kernel charges the per-user counts its processes make (inotify
// instances and watches, queued signals, user namespaces, ...) at every
// level up to the host's, and at the host's to the namespace's owner. A
// namespace made by root charges every sandbox's to root, whose one budget
// one sandbox could then exhaust for the host and every other sandbox.
//
// Credentials are per thread: only the calling thread changes, for the
// moment of the fork, keeping its capabilities (effective), so that the
// fork's own steps (clone3 into a cgroup, the id maps written by the
// parent) are still root's. The thread is locked meanwhile; one whose
// credentials could not be put back stays locked, and so ends with its
// goroutine (the caller's must end: a Spawn goroutine, a request's).
func ForkOwned(uid, gid int, fork func() (int, error)) (int, error) {
	if uid <= 0 || gid <= 0 {
		return 0, fmt.Errorf("fork owned by uid %d gid %d: not a sandbox's ids", uid, gid)
	}
	runtime.LockOSThread()
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		runtime.UnlockOSThread()
		return 0, fmt.Errorf("capget: %w", err)
	}
	// A change of ids makes the process undumpable (suid_dumpable); it is
	// put back as it was.
	dumpable, _ := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
	restored := true
	defer func() {
		if restored {
			_ = unix.Prctl(unix.PR_SET_DUMPABLE, uintptr(dumpable), 0, 0, 0)
			runtime.UnlockOSThread()
		}
	}()
	const keep = ^uintptr(0) // -1: leave the id as it is
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keep, uintptr(gid), keep); e != 0 {
		return 0, fmt.Errorf("setresgid for the fork: %w", e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, uintptr(uid), keep); e != 0 {
		restored = putBack(hdr, caps)
		return 0, fmt.Errorf("setresuid for the fork: %w", e)
	}
	// A change of the effective uid from 0 empties the effective set (the
	// permitted one stays: the real and saved uids are still 0).
	if err := capset(hdr, caps); err != nil {
		restored = putBack(hdr, caps)
		return 0, fmt.Errorf("capset for the fork: %w", err)
	}
	pid, err := fork()
	restored = putBack(hdr, caps)
	if !restored && err == nil {
		err = errors.New("the forking thread's credentials could not be put back")
	}
	return pid, err
}

// putBack gives the thread its ids and capabilities again (a change of the
// effective uid to 0 restores the effective set from the permitted one),
// and reports whether it has them.
func putBack(hdr unix.CapUserHeader, caps [2]unix.CapUserData) bool {
	const keep = ^uintptr(0)
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, 0, keep); e != 0 {
		return false
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, keep, 0, keep); e != 0 {
		return false
	}
	if capset(hdr, caps) != nil {
		return false
	}
	_, eu, _ := unix.Getresuid()
	_, eg, _ := unix.Getresgid()
	return eu == 0 && eg == 0
}

// capset sets the calling thread's capabilities.
func capset(hdr unix.CapUserHeader, caps [2]unix.CapUserData) error {
	h := hdr // the kernel may write the header
	return unix.Capset(&h, &caps[0])
}
