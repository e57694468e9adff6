//go:build linux && amd64

package seccomp

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Install sets no_new_privs and installs the filter on every thread of the calling
// process (SECCOMP_FILTER_FLAG_TSYNC). Children inherit it.
//
// Installing is irreversible. Calling Install again stacks a second copy of
// the filter, which changes nothing but the cost of each syscall.
func Install() error {
	prog, err := Program()
	if err != nil {
		return err
	}
	return install(prog)
}

func install(prog []unix.SockFilter) error {
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}

	// no_new_privs is a per-thread flag: set it and install the filter from
	// the same thread. TSYNC then copies both the filter and no_new_privs to
	// every other thread of the process.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: prctl(PR_SET_NO_NEW_PRIVS): %w", err)
	}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP,
		unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC,
		uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if errno != 0 {
		return fmt.Errorf("seccomp: seccomp(SECCOMP_SET_MODE_FILTER): %w", errno)
	}
	if r != 0 {
		// With TSYNC, a positive return is the id of a thread that could not
		// be synchronized (it has a diverging filter); nothing was installed.
		return fmt.Errorf("seccomp: thread %d could not be synchronized", r)
	}
	return nil
}
