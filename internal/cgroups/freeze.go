package cgroups

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Freezing a group stops every task in it where it stands (CPU zero, memory
// kept): a sandbox paused with its memory on walls that cannot checkpoint
// it. v1: the freezer controller's freezer.state; v2: cgroup.freeze.

// ErrNoFreezer is returned where the host has no freezer for the group.
var ErrNoFreezer = errors.New("this host's cgroups have no freezer")

// Freeze stops every task of the group and waits until the kernel says
// they all are (or ctx ends, and the group is thawed again). The v1
// freezer can stay FREEZING for good when it meets a task between states
// (a known livelock, worse under load): a try that has not frozen in a
// while is thawed and tried again.
func (cg *Cgroup) Freeze(ctx context.Context) error {
	file, want, err := cg.freezeFile(true)
	if err != nil {
		return err
	}
	for try := 0; ; try++ {
		if err := os.WriteFile(file, []byte(want), 0); err != nil {
			return fmt.Errorf("freeze: %w", err)
		}
		deadline := time.Now().Add(freezeTry(try))
		for {
			if frozen, err := cg.Frozen(); err != nil || frozen {
				return err
			}
			if cg.m.Mode != V2 && time.Now().After(deadline) {
				break // thaw and try again
			}
			select {
			case <-ctx.Done():
				_ = cg.Thaw()
				return fmt.Errorf("freeze: %w", ctx.Err())
			case <-time.After(time.Millisecond):
			}
		}
		if err := cg.Thaw(); err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
}

// freezeTry is how long try n waits for a v1 group to freeze before it
// thaws it and tries again: 50 ms at first, at most a second.
func freezeTry(n int) time.Duration {
	return min(50*time.Millisecond<<min(n, 5), time.Second)
}

// Thaw lets the group's tasks run again.
func (cg *Cgroup) Thaw() error {
	file, want, err := cg.freezeFile(false)
	if err != nil {
		return err
	}
	if err := os.WriteFile(file, []byte(want), 0); err != nil {
		return fmt.Errorf("thaw: %w", err)
	}
	return nil
}

// Frozen reports whether every task of the group is frozen.
func (cg *Cgroup) Frozen() (bool, error) {
	if cg.m.Mode == V2 {
		b, err := os.ReadFile(filepath.Join(cg.dirs["unified"], "cgroup.events"))
		if err != nil {
			return false, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if line == "frozen 1" {
				return true, nil
			}
		}
		return false, nil
	}
	dir, ok := cg.dirs["freezer"]
	if !ok {
		return false, ErrNoFreezer
	}
	b, err := os.ReadFile(filepath.Join(dir, "freezer.state"))
	if err != nil {
		return false, err
	}
	return strings.TrimSpace(string(b)) == "FROZEN", nil
}

func (cg *Cgroup) freezeFile(freeze bool) (file, value string, err error) {
	if cg.m.Mode == V2 {
		if freeze {
			return filepath.Join(cg.dirs["unified"], "cgroup.freeze"), "1", nil
		}
		return filepath.Join(cg.dirs["unified"], "cgroup.freeze"), "0", nil
	}
	dir, ok := cg.dirs["freezer"]
	if !ok {
		return "", "", ErrNoFreezer
	}
	if freeze {
		return filepath.Join(dir, "freezer.state"), "FROZEN", nil
	}
	return filepath.Join(dir, "freezer.state"), "THAWED", nil
}

// thawDir thaws the group at dir, whichever kind it is (teardown: a frozen
// task does not die until thawed).
func thawDir(dir string) {
	if exists(filepath.Join(dir, "cgroup.freeze")) {
		_ = os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("0"), 0)
	}
	if exists(filepath.Join(dir, "freezer.state")) {
		_ = os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0)
	}
}
