package process

import (
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// A sandbox outlives the process that created it (a daemon that crashed or
// was upgraded). adopt takes charge of such a sandbox again: the agent is not
// this process's child, so its exit is watched through a pidfd.

// adopt returns the running sandbox a.ID whose agent is a.PID, started at
// a.StartTime. It fails when that process is gone or is not the sandbox's.
func adopt(cfg Config, a wall.Adoption) (*Sandbox, error) {
	if st, err := hostproc.StartTime(a.PID); err != nil || st != a.StartTime {
		return nil, fmt.Errorf("sandbox %s: its agent (pid %d) is gone", a.ID, a.PID)
	}
	cg := cfg.Cgroups.Open(a.ID)
	if !contains(cg.Procs(), a.PID) {
		return nil, fmt.Errorf("sandbox %s: pid %d is not in its cgroup", a.ID, a.PID)
	}
	pidfd, err := unix.PidfdOpen(a.PID, 0)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: pidfd: %w", a.ID, err)
	}
	sb := &Sandbox{id: a.ID, token: a.Token, pid: a.PID, cg: cg, started: true, pidfd: pidfd,
		dir: filepath.Join(cfg.RunDir, "sandboxes", a.ID), exited: make(chan struct{}),
		log: cfg.Log.With("sandbox", a.ID)}
	sb.sock = filepath.Join(sb.dir, "agent.sock")
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		unix.Close(pidfd)
		return nil, fmt.Errorf("sandbox %s: %w", a.ID, err)
	}
	// The host's lock of its slot died with its creator: take it again.
	if a.Slot >= 0 {
		if sb.ids, err = state.AdoptSlot(a.Slot); err != nil {
			sb.log.Warn("adopted without its slot's lock", "slot", a.Slot, "err", err)
		}
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
