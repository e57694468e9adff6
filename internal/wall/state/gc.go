package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
)

// Each sandbox's state directory holds an owner lock, flock'ed by the process
// that created it for as long as it lives. A sandbox whose owner died (a
// `cage run` killed with SIGKILL takes its sandbox's processes with it, but
// not its directories and cgroups) is found by GC and removed.

const ownerLockName = "owner.lock"

// ErrInUse is a create's for an id whose state directory exists: a live
// sandbox's (or one GC has not removed yet), which the failed create must
// leave alone.
var ErrInUse = errors.New("a sandbox with this id exists on the host")

// MakeDir makes a sandbox's state directory, the claim of its id on the
// host: ErrInUse when it exists.
func MakeDir(dir string, perm os.FileMode) error {
	if err := os.Mkdir(dir, perm); err != nil {
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("sandbox %s: %w", filepath.Base(dir), ErrInUse)
		}
		return err
	}
	return nil
}

func LockOwner(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, ownerLockName), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock sandbox state: %w", err)
	}
	return f, nil
}

// RemoveState removes a sandbox's state directory with what is in it (its
// socket, the root directory, the owner lock) and what is mounted in it
// (an OCI wall's root and disk tmpfs, an image's overlay, a network
// namespace's file), detached first: see RemoveTree, which never follows a
// link nor leaves the directory's file system. The runtime's own state for
// the sandbox (RUN_DIR/<wall>/<id>) goes with it.
func RemoveState(dir string) error {
	id := filepath.Base(dir)
	runDir := filepath.Dir(filepath.Dir(dir))
	for _, w := range []string{"runc", "gvisor"} {
		// runc keeps a directory per container; runsc files named after it.
		ents, _ := os.ReadDir(filepath.Join(runDir, w))
		for _, e := range ents {
			if strings.Contains(e.Name(), id) {
				_ = RemoveTree(filepath.Join(runDir, w, e.Name()))
			}
		}
	}
	return RemoveTree(dir)
}

// GC removes what dead owners left behind under runDir: the state directory
// and cgroups of each sandbox whose owner is gone and which has no process
// left (GCDirs), and uid-range locks nobody holds (GCIDLocks). It returns
// the ids it removed.
func GC(runDir string, cg *cgroups.Manager) ([]string, error) {
	removed, err := GCDirs(runDir, cg)
	GCIDLocks()
	return removed, err
}

// GCDirs removes the state directory and cgroups of each sandbox under
// runDir whose owner is gone and which has no process left. A sandbox that
// still has processes is left alone (a daemon may adopt it). It returns
// the ids it removed.
func GCDirs(runDir string, cg *cgroups.Manager) ([]string, error) {
	base := filepath.Join(runDir, "sandboxes")
	ents, err := os.ReadDir(base)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, e := range ents {
		id := e.Name()
		dir := filepath.Join(base, id)
		if fi, err := e.Info(); err != nil || time.Since(fi.ModTime()) < orphanGrace {
			continue // being created: its owner may not hold the lock yet
		}
		lock, err := LockOwner(dir)
		if err != nil {
			continue // its owner is alive
		}
		group := cg.Open(id)
		if len(group.Procs()) > 0 {
			lock.Close()
			continue
		}
		if err := group.Destroy(); err != nil {
			errs = append(errs, err)
		} else if err := RemoveState(dir); err != nil {
			errs = append(errs, err)
		} else {
			removed = append(removed, id)
		}
		lock.Close()
	}
	return removed, errors.Join(errs...)
}

// Remove kills whatever is left of sandbox id (every process in its cgroups)
// and removes its cgroups and state directory. For a sandbox whose owner is
// gone and which nobody will adopt.
func Remove(runDir string, cg *cgroups.Manager, id string) error {
	if err := cg.Open(id).Destroy(); err != nil {
		return err
	}
	return RemoveState(filepath.Join(runDir, "sandboxes", id))
}

// Orphans lists sandboxes under runDir that no live process owns: state
// directories whose owner lock is free (a directory younger than orphanGrace may
// still be getting its lock, and is left alone). Cgroups are not scanned:
// other run directories share the cgroup parent.
func Orphans(runDir string) []string {
	var out []string
	base := filepath.Join(runDir, "sandboxes")
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		if fi, err := e.Info(); err != nil || time.Since(fi.ModTime()) < orphanGrace {
			continue
		}
		lock, err := LockOwner(filepath.Join(base, e.Name()))
		if err != nil {
			continue
		}
		lock.Close()
		out = append(out, e.Name())
	}
	return out
}

// orphanGrace is how old a state directory must be before GC and Orphans
// judge it: its creator takes the owner lock microseconds after making it.
const orphanGrace = 2 * time.Second
