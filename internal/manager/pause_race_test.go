package manager

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

// runningSandbox stands for a sandbox a resume has just started.
type runningSandbox struct {
	wall.Sandbox
	id        string
	exited    chan struct{}
	destroyed bool
}

func (f *runningSandbox) ID() string              { return f.id }
func (f *runningSandbox) Exited() <-chan struct{} { return f.exited }
func (f *runningSandbox) Cgroup() *cgroups.Cgroup { return nil }
func (f *runningSandbox) AgentPID() int           { return 0 }
func (f *runningSandbox) Destroy() error          { f.destroyed = true; return nil }
func (f *runningSandbox) Err() error              { return nil }

// Attack (a tenant's own timing): connect to a sandbox paused with its
// files just as its paused retention runs out. The sweep read every record,
// waited for the sandbox's transition lock while the resume held it, then
// removed the sandbox from the record it had read: the resumed sandbox
// ran on with no record (404 to its owner, out of its team's quota, beyond
// Kill, until its old timer or a restart). Expected: the sweep reads the
// record again under the lock and leaves a sandbox that is no longer
// paused alone; one still paused past the retention is removed.
func TestExpirePausedLeavesAResumedSandbox(t *testing.T) {
	data := t.TempDir()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m := New(Config{Store: st, Data: data, PausedRetention: time.Second})
	paused := func(id string) *store.Sandbox {
		rec := &store.Sandbox{ID: id, KeyID: "team-x", State: store.StatePaused, PauseKind: PauseFiles, NetSlot: -1,
			StartedAt: time.Now().Add(-2 * time.Hour), PausedAt: time.Now().Add(-time.Hour), EndAt: time.Now(), Memory: 512 << 20, CPUs: 1}
		if err := st.InsertSandbox(rec); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(data, "paused"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m.savedFiles(id), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		return rec
	}
	const resumed, left = "0123456789abcdef0123", "0123456789abcdef0122"
	paused(left) // first: the sweep goes by start time
	rec := paused(resumed)
	unlock := m.transition(resumed) // a resume in progress holds it
	done := make(chan struct{})
	go func() { m.expirePaused(); close(done) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := st.GetSandbox(left); errors.Is(err, store.ErrNotFound) {
			break // the sweep is past the other one: it read both records
		}
		if time.Now().After(deadline) {
			t.Fatal("the sweep never removed the sandbox left paused")
		}
	}
	sb := &runningSandbox{id: resumed, exited: make(chan struct{})}
	rec.State, rec.PausedAt, rec.PauseKind, rec.EndAt = store.StateRunning, time.Time{}, "", time.Now().Add(time.Hour)
	if err := st.UpdateSandbox(rec); err != nil {
		t.Fatal(err)
	}
	m.track(sb, rec)
	unlock()
	<-done
	if got, err := st.GetSandbox(resumed); err != nil || got.State != store.StateRunning {
		t.Errorf("the resumed sandbox after the sweep: %+v, %v; want its record, running", got, err)
	}
	if sb.destroyed {
		t.Error("the sweep destroyed the resumed sandbox")
	}
	if u, err := st.Usage("team-x", PauseMemory); err != nil || u.Sandboxes != 1 {
		t.Errorf("the team's usage: %+v, %v; want the resumed sandbox counted", u, err)
	}
	if err := m.Kill("team-x", resumed); err != nil {
		t.Errorf("its owner's kill: %v", err)
	}
}
