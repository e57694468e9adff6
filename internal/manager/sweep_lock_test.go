package manager

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
)

// Attack (a tenant's own timing): a resume holds its sandbox's transition
// lock through its agent's restore, which a tree of the sandbox's making
// stretches to hours, for as long as the tenant keeps the request open.
// The sweep (one loop for every tenant: orphans and GC, the paused
// retention, revoked keys) waited for that lock when the sandbox was past
// its paused retention, or its key was revoked (an abusive key revoked by
// the operator, with a slow resume still in flight): every later sandbox
// of the sweep, and every later sweep, waited with it. Expected: each
// sweep passes a sandbox whose lock is held by, does the rest of its work
// at once, and takes the sandbox at a later sweep once the lock is free.
func TestSweepsPassHeldSandboxes(t *testing.T) {
	data := t.TempDir()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m := New(Config{Store: st, Data: data, PausedRetention: time.Second})
	if err := os.MkdirAll(filepath.Join(data, "paused"), 0o700); err != nil {
		t.Fatal(err)
	}
	paused := func(id, key string, started time.Time) {
		t.Helper()
		rec := &store.Sandbox{ID: id, KeyID: key, State: store.StatePaused, PauseKind: PauseFiles, NetSlot: -1,
			StartedAt: started, PausedAt: time.Now().Add(-time.Hour), EndAt: time.Now(), Memory: 512 << 20, CPUs: 1}
		if err := st.InsertSandbox(rec); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.savedFiles(id), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	gone := func(id string) bool {
		_, err := st.GetSandbox(id)
		return errors.Is(err, store.ErrNotFound)
	}
	inTime := func(what string, f func()) {
		t.Helper()
		done := make(chan struct{})
		go func() { f(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s waited for a lock a resume holds", what)
		}
	}

	// The paused retention: the held sandbox comes first (the sweep goes
	// by start time), another tenant's after it.
	const held, other = "0123456789abcdef0a01", "0123456789abcdef0a02"
	paused(held, "team-a", time.Now().Add(-3*time.Hour))
	paused(other, "team-b", time.Now().Add(-2*time.Hour))
	unlock := m.transition(held) // a resume in progress
	inTime("the paused retention's sweep", m.expirePaused)
	if !gone(other) {
		t.Error("another tenant's sandbox, paused past the retention, was not removed")
	}
	if gone(held) {
		t.Error("the sweep removed a sandbox whose resume holds its lock")
	}
	unlock()
	m.expirePaused()
	if !gone(held) {
		t.Error("the next sweep did not remove the sandbox once its lock was free")
	}

	// A revoked key's: its sandbox whose resume holds the lock is passed
	// by; its other sandbox and its snapshot go at once.
	_, key, err := st.CreateKey("abusive")
	if err != nil {
		t.Fatal(err)
	}
	const resuming, idle = "0123456789abcdef0b01", "0123456789abcdef0b02"
	paused(resuming, key.ID, time.Now().Add(-3*time.Hour))
	paused(idle, key.ID, time.Now().Add(-2*time.Hour))
	sn := &store.Snapshot{ID: "snaprevoked00000000000", KeyID: key.ID, Kind: PauseFiles, CreatedAt: time.Now()}
	if err := st.InsertSnapshot(sn); err != nil {
		t.Fatal(err)
	}
	if _, err := st.RevokeKey(key.ID); err != nil {
		t.Fatal(err)
	}
	unlock = m.transition(resuming)
	inTime("the revoked keys' sweep", m.removeRevoked)
	if !gone(idle) {
		t.Error("the revoked key's idle sandbox was not removed")
	}
	if _, err := st.GetSnapshot(key.ID, sn.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the revoked key's snapshot: %v; want it removed", err)
	}
	if gone(resuming) {
		t.Error("the sweep removed a sandbox whose resume holds its lock")
	}
	unlock()
	m.removeRevoked()
	if !gone(resuming) {
		t.Error("the next sweep did not remove the revoked key's sandbox once its lock was free")
	}
	m.transMu.Lock()
	n := len(m.transitions)
	m.transMu.Unlock()
	if n != 0 {
		t.Errorf("%d transition locks left after the sweeps", n)
	}
}
