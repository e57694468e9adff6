package manager

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

// checkpointingSandbox stands for a sandbox a pause is checkpointing.
type checkpointingSandbox struct {
	wall.Sandbox
	id        string
	exited    chan struct{}
	destroyed atomic.Bool
}

func (f *checkpointingSandbox) ID() string              { return f.id }
func (f *checkpointingSandbox) Exited() <-chan struct{} { return f.exited }
func (f *checkpointingSandbox) Cgroup() *cgroups.Cgroup { return nil }
func (f *checkpointingSandbox) AgentPID() int           { return 0 }
func (f *checkpointingSandbox) Destroy() error          { f.destroyed.Store(true); return nil }
func (f *checkpointingSandbox) Err() error              { return nil }

// Attack (a tenant's own timing): pause a sandbox just as its timeout
// runs out. The end timer fired as the pause began, and the timeout
// destroyed the sandbox without its transition lock, during the
// checkpoint: the wall's teardown ran beside the checkpoint's own (the
// OCI wall closed the sandbox's pidfd from both, the second time closing
// whatever file of the daemon had taken the number). Expected: the
// timeout waits for the pause, and a sandbox the pause left paused does
// not time out.
func TestTimeoutWaitsForAPause(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m := New(Config{Store: st, Data: t.TempDir()})
	const id = "0123456789abcdef0124"
	rec := &store.Sandbox{ID: id, KeyID: "team-x", State: store.StateRunning, NetSlot: -1,
		StartedAt: time.Now(), EndAt: time.Now().Add(time.Hour), Memory: 512 << 20, CPUs: 1}
	if err := st.InsertSandbox(rec); err != nil {
		t.Fatal(err)
	}
	sb := &checkpointingSandbox{id: id, exited: make(chan struct{})}
	m.track(sb, rec)

	unlock := m.transition(id) // the pause, checkpointing
	done := make(chan struct{})
	go func() { m.timedOut(id); close(done) }()
	time.Sleep(300 * time.Millisecond)
	if sb.destroyed.Load() {
		t.Error("the timeout destroyed the sandbox while its pause held the transition lock")
	}
	rec.State, rec.PausedAt, rec.PauseKind = store.StatePaused, time.Now(), PauseCheckpoint
	if err := st.UpdateSandbox(rec); err != nil {
		t.Fatal(err)
	}
	unlock()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the timeout did not return once the pause let go")
	}
	if sb.destroyed.Load() {
		t.Error("the timeout destroyed a sandbox its pause had left paused")
	}
	if got, err := st.GetSandbox(id); err != nil || got.State != store.StatePaused {
		t.Errorf("the paused sandbox after the timeout: %+v, %v; want its record, paused", got, err)
	}
}

// Attack (a tenant's own timing): resume a paused sandbox, or give it a
// new timeout, just as its end timer fires. The timer's call waits for
// the transition lock the resume holds; when it gets it, the sandbox runs
// again with an end an hour away. Expected: the old timer does not kill
// it (the new end's timer stands). (An autoPause sandbox's pause at its
// timeout reads the same check; this manager has no walls to pause on.)
func TestTimeoutAfterAResumeLeavesIt(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m := New(Config{Store: st, Data: t.TempDir()})
	const id = "0123456789abcdef0125"
	rec := &store.Sandbox{ID: id, KeyID: "team-x", State: store.StateRunning, NetSlot: -1,
		StartedAt: time.Now(), EndAt: time.Now().Add(time.Hour), Memory: 512 << 20, CPUs: 1}
	if err := st.InsertSandbox(rec); err != nil {
		t.Fatal(err)
	}
	sb := &checkpointingSandbox{id: id, exited: make(chan struct{})}
	m.track(sb, rec)
	// Its end is now: the timer's call (made here, not by the armed
	// timer) finds it due.
	rec.EndAt = time.Now()
	if err := st.UpdateSandbox(rec); err != nil {
		t.Fatal(err)
	}
	unlock := m.transition(id) // the resume
	done := make(chan struct{})
	go func() { m.timedOut(id); close(done) }()
	time.Sleep(300 * time.Millisecond)
	rec.EndAt = time.Now().Add(time.Hour)
	if err := st.UpdateSandbox(rec); err != nil {
		t.Fatal(err)
	}
	unlock()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the timeout did not return once the resume let go")
	}
	if sb.destroyed.Load() {
		t.Error("the old timer destroyed a sandbox resumed with an hour to run")
	}
	if got, err := st.GetSandbox(id); err != nil || got.State != store.StateRunning {
		t.Errorf("the sandbox after the old timer: %+v, %v; want it running", got, err)
	}
	m.mu.Lock()
	e := m.live[id]
	m.mu.Unlock()
	if e != nil {
		e.timer.Stop()
	}
}
