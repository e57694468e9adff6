// Package hostproc names and watches host processes that are not this
// process's children: a process's start time (with its pid, a name that
// survives pid reuse) and waiting on a pidfd. Every wall's host half uses it
// to adopt sandboxes another process created. And Foreground, for the
// walls that start a pool's sandboxes niced.
package hostproc

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// StartTime is the start time of pid (field 22 of /proc/PID/stat).
func StartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold spaces
	if i < 0 {
		return 0, errors.New("malformed stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, errors.New("malformed stat")
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// WaitPidfd blocks until the process behind pidfd has exited (or the poll
// fails for good). It waits in the runtime's poller, not in a thread of
// its own: a daemon watches every sandbox's agent this way, and a blocked
// thread per sandbox was a thousand threads with a thousand alive.
func WaitPidfd(pidfd int) {
	if waitPolled(pidfd) {
		return
	}
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if err == nil || !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

// waitPolled waits on a duplicate of pidfd registered with the runtime's
// poller; false if it could not be (then the caller polls itself).
func waitPolled(pidfd int) bool {
	dup, err := unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return false
	}
	// Non-blocking is a flag of the open file the duplicate shares, which
	// only waitid(P_PIDFD) would see; nothing here uses it.
	if err := unix.SetNonblock(dup, true); err != nil {
		unix.Close(dup)
		return false
	}
	f := os.NewFile(uintptr(dup), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return false
	}
	exited := func(fd uintptr) bool {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		return err == nil && n > 0
	}
	return rc.Read(exited) == nil
}
