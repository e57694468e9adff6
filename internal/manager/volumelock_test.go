package manager

import (
	"testing"
	"time"
)

// TestVolumeLockPerOwner: a create of team A that mounts A's volumes holds
// A's volume lock for its start, and only A's: B's volume create or
// delete goes on at once, A's waits for the create; no lock is left once
// none is held (found by review, 2026-12-03: one lock for the daemon).
func TestVolumeLockPerOwner(t *testing.T) {
	m := &Manager{}
	unlockA := m.lockVolumes("team_a", false) // A's create, starting

	done := make(chan struct{})
	go func() { m.lockVolumes("team_b", true)(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("B's volume change waits for A's create")
	}

	aWrite := make(chan struct{})
	go func() { m.lockVolumes("team_a", true)(); close(aWrite) }()
	select {
	case <-aWrite:
		t.Fatal("A's volume change went on while A's create held its volumes")
	case <-time.After(100 * time.Millisecond):
	}
	unlockA()
	<-aWrite
	m.volMu.Lock()
	defer m.volMu.Unlock()
	if len(m.volLocks) != 0 {
		t.Errorf("locks left: %v", m.volLocks)
	}
}
