package process

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/wall/state"
)

// A sandbox outlives the process that created it (a daemon that crashed or
// was upgraded). Adopt takes charge of such a sandbox again: the agent is not
// this process's child, so its exit is watched through a pidfd.

// Adopt returns the running sandbox cfg.ID whose agent is pid, started at
// startTime. It fails when that process is gone or is not the sandbox's.
func Adopt(cfg Config, pid int, startTime uint64, token string) (*Sandbox, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if st, err := hostproc.StartTime(pid); err != nil || st != startTime {
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
	hostproc.WaitPidfd(sb.pidfd)
	close(sb.exited)
}

func contains(pids []int, pid int) bool {
	for _, p := range pids {
		if p == pid {
			return true
		}
	}
	return false
}
