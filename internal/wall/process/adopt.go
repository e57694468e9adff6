package process

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/wall/state"
)

// A sandbox outlives the process that created it (a daemon that crashed or
// was upgraded). Adopt takes charge of such a sandbox again: the agent is not
// this process's child, so its exit is watched through a pidfd.

// StartTime is the start time of pid (field 22 of /proc/PID/stat), which,
// with the pid, names a process unambiguously across pid reuse.
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

// Adopt returns the running sandbox cfg.ID whose agent is pid, started at
// startTime. It fails when that process is gone or is not the sandbox's.
func Adopt(cfg Config, pid int, startTime uint64, token string) (*Sandbox, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if st, err := StartTime(pid); err != nil || st != startTime {
		return nil, fmt.Errorf("sandbox %s: its agent (pid %d) is gone", cfg.ID, pid)
	}
	cg := cfg.Cgroups.Open(cfg.ID)
	if !contains(cg.Procs(), pid) {
		return nil, fmt.Errorf("sandbox %s: pid %d is not in its cgroup", cfg.ID, pid)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: pidfd: %w", cfg.ID, err)
	}
	sb := &Sandbox{id: cfg.ID, token: token, pid: pid, cg: cg, started: true, pidfd: pidfd,
		dir: filepath.Join(cfg.RunDir, "sandboxes", cfg.ID), exited: make(chan struct{}),
		log: cfg.Log.With("sandbox", cfg.ID)}
	sb.sock = filepath.Join(sb.dir, "agent.sock")
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		unix.Close(pidfd)
		return nil, fmt.Errorf("sandbox %s: %w", cfg.ID, err)
	}
	go sb.watchPidfd()
	return sb, nil
}

func (sb *Sandbox) watchPidfd() {
	WaitPidfd(sb.pidfd)
	close(sb.exited)
}

// WaitPidfd blocks until the process behind pidfd has exited (or the poll
// fails for good).
func WaitPidfd(pidfd int) {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if err == nil || !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

func contains(pids []int, pid int) bool {
	for _, p := range pids {
		if p == pid {
			return true
		}
	}
	return false
}
