package conformance

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/wall/state"
)

// TestSandboxCannotFreeItsSlot: the lock a sandbox's host process
// inherits, which keeps its uid range and network slot reserved while it
// lives, is never the host's own. A hostile agent that unlocks it (flock's
// locks belong to the open file, which the host would share) leaves the
// slot reserved: no second sandbox can get its uid range while it runs.
// It cannot write through it either (a host file outside every limit).
func TestSandboxCannotFreeItsSlot(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		pid := b.sb.AgentPID()
		fds := lockFDs(pid)
		if len(fds) == 0 {
			if w.name == "process" || w.name == "runc" {
				t.Fatalf("the agent (pid %d) holds no lock under %s", pid, state.IDLockDir)
			}
			t.Skipf("no process of the sandbox on the host holds a slot lock on %s", w.name)
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(pidfd)
		for fd, target := range fds {
			name := filepath.Base(target)
			if !strings.HasSuffix(name, ".held") {
				t.Errorf("the agent's fd %d is the host's own lock %s", fd, target)
			}
			slot, err := strconv.Atoi(strings.TrimSuffix(name, ".held"))
			if err != nil {
				t.Fatalf("lock %s: %v", target, err)
			}
			// What code in the agent could do with its descriptor.
			dup, err := unix.PidfdGetfd(pidfd, fd, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := unix.Write(dup, []byte("x")); err == nil {
				t.Errorf("the agent wrote to its lock file %s", target)
			}
			if err := unix.Flock(dup, unix.LOCK_UN); err != nil {
				t.Fatal(err)
			}
			unix.Close(dup)
			if r, err := state.ReserveSlot(slot); err == nil {
				r.Close()
				t.Errorf("slot %d was free to reserve while its sandbox runs (it unlocked its lock)", slot)
			}
			if !state.SlotHeld(slot) {
				t.Errorf("slot %d reads as free while its sandbox runs", slot)
			}
		}
		if got := b.mustSh("echo alive"); got != "alive\n" {
			t.Errorf("the sandbox after its lock was let go: %q", got)
		}
	})
}

// lockFDs lists pid's descriptors open on files under state.IDLockDir.
func lockFDs(pid int) map[int]string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(dir)
	out := map[int]string{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil || !strings.HasPrefix(target, state.IDLockDir+"/") {
			continue
		}
		if fd, err := strconv.Atoi(e.Name()); err == nil {
			out[fd] = target
		}
	}
	return out
}

// TestCreateWithALiveID: a create given the id of a sandbox that runs
// (a pool's member, a `cage run`, a cluster's pod name: none is in the
// daemon's store) fails, and leaves that sandbox, its directory and its
// processes alone.
func TestCreateWithALiveID(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		h := processHost(t)
		o := sandbox.Options{ID: b.sb.ID(), Wall: w.name}
		if w.name == "microvm" {
			requireBase(t, h)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		sb, err := h.Create(ctx, o)
		if err == nil {
			sb.Destroy()
			t.Fatalf("a second sandbox was created with the id %s", b.sb.ID())
		}
		t.Logf("create with a live id: %v", err)
		if got := b.mustSh("echo alive"); got != "alive\n" {
			t.Errorf("the live sandbox after the failed create: %q", got)
		}
		select {
		case <-b.sb.Exited():
			t.Error("the live sandbox reads as gone after the failed create")
		default:
		}
	})
}
