package manager

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

func quotaManager(t *testing.T, lim store.TeamLimits) (*Manager, *store.Store, *store.Team) {
	t.Helper()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	team, err := st.CreateTeam("alpha", lim)
	if err != nil {
		t.Fatal(err)
	}
	return New(Config{Store: st}), st, team
}

// createAs is what Create does with the quota around the record: reserve,
// record (as creating, then running), release.
func createAs(m *Manager, st *store.Store, owner, id string, opts sandbox.Options) error {
	q, err := m.reserve(owner, createNeed(&opts))
	if err != nil {
		return err
	}
	defer q.release()
	need := createNeed(&opts)
	rec := &store.Sandbox{ID: id, KeyID: owner, State: store.StateCreating, CPUs: need.CPUs, Memory: need.Memory,
		Disk: need.Disk, StartedAt: time.Now()}
	if err := q.record(func() error { return st.InsertSandbox(rec) }); err != nil {
		return err
	}
	return st.SetState(id, store.StateRunning)
}

// Attack: one team's key creates as many sandboxes at once as it can.
// Expected: exactly its quota are made, every other create is ErrQuota
// naming the quota, and a kill frees a place.
func TestQuotaConcurrentCreates(t *testing.T) {
	m, st, team := quotaManager(t, store.TeamLimits{Sandboxes: 5})
	var wg sync.WaitGroup
	errs := make([]error, 40)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = createAs(m, st, team.ID, fmt.Sprintf("sb%d", i), sandbox.Options{CPUs: 0.1})
		}()
	}
	wg.Wait()
	made := 0
	for _, err := range errs {
		switch {
		case err == nil:
			made++
		case !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), `team "alpha"'s quota of 5 concurrent sandboxes`):
			t.Errorf("refused with %v", err)
		}
	}
	if made != 5 {
		t.Fatalf("%d sandboxes made, want exactly the quota of 5", made)
	}
	if len(m.quotas.held) != 0 {
		t.Errorf("reservations left: %v", m.quotas.held)
	}
	// Another owner (a key without a team) is not held by alpha's quota.
	if err := createAs(m, st, "key_000000000001", "other", sandbox.Options{}); err != nil {
		t.Errorf("a key without a team: %v", err)
	}
	recs, _, _ := st.ListSandboxes(store.ListFilter{KeyID: team.ID})
	if err := st.DeleteSandbox(recs[0].ID); err != nil { // a kill
		t.Fatal(err)
	}
	if err := createAs(m, st, team.ID, "afterkill", sandbox.Options{}); err != nil {
		t.Errorf("after a kill: %v", err)
	}
	if err := createAs(m, st, team.ID, "onemore", sandbox.Options{}); !errors.Is(err, ErrQuota) {
		t.Errorf("over the quota again: %v", err)
	}
}

// Each quota is hit exactly at its limit and names itself.
func TestQuotaEachLimit(t *testing.T) {
	for _, c := range []struct {
		lim       store.TeamLimits
		opts      sandbox.Options
		fits      int
		wantInMsg string
	}{
		{store.TeamLimits{CPUs: 2}, sandbox.Options{CPUs: 0.5}, 4, "quota of 2 vCPUs is reached (2 in use, 0.50 asked)"},
		{store.TeamLimits{Memory: 1 << 30}, sandbox.Options{}, 2, "quota of 1024 MiB memory is reached (1024 MiB in use, 512 MiB asked)"},
		{store.TeamLimits{Disk: 1 << 30}, sandbox.Options{Disk: 300 << 20}, 3, "quota of 1024 MiB disk"},
	} {
		m, st, team := quotaManager(t, c.lim)
		for i := range c.fits {
			if err := createAs(m, st, team.ID, fmt.Sprint("s", i), c.opts); err != nil {
				t.Fatalf("%+v: create %d of %d: %v", c.lim, i+1, c.fits, err)
			}
		}
		err := createAs(m, st, team.ID, "over", c.opts)
		if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), c.wantInMsg) {
			t.Errorf("%+v: one over: %v, want %q", c.lim, err, c.wantInMsg)
		}
	}
}

// Paused sandboxes: a pause over the quota is refused, and resuming takes
// a running place (and the memory of a sandbox paused with its files).
func TestQuotaPausedAndResume(t *testing.T) {
	m, st, team := quotaManager(t, store.TeamLimits{Paused: 1, Sandboxes: 1, Memory: 1 << 30})
	now := time.Now()
	for _, sb := range []*store.Sandbox{
		{ID: "p1", KeyID: team.ID, State: store.StatePaused, PauseKind: PauseFiles, CPUs: 1, Memory: 768 << 20, StartedAt: now},
		{ID: "r1", KeyID: team.ID, State: store.StateRunning, CPUs: 1, Memory: 256 << 20, StartedAt: now},
	} {
		if err := st.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	_, err := m.reserve(team.ID, store.Usage{Paused: 1})
	if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "quota of 1 paused sandboxes") {
		t.Errorf("a second pause: %v", err)
	}
	p1, _ := st.GetSandbox("p1")
	if _, err := m.reserve(team.ID, resumeNeed(p1)); !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "concurrent sandboxes") {
		t.Errorf("resume while the one place is taken: %v", err)
	}
	if err := st.DeleteSandbox("r1"); err != nil {
		t.Fatal(err)
	}
	q, err := m.reserve(team.ID, resumeNeed(p1))
	if err != nil {
		t.Fatalf("resume once the place is free: %v", err)
	}
	if _, err := m.reserve(team.ID, store.Usage{Sandboxes: 1}); !errors.Is(err, ErrQuota) {
		t.Errorf("a create while a resume holds the place: %v", err)
	}
	q.release()
	q.release() // twice is once
	if len(m.quotas.held) != 0 {
		t.Errorf("reservations left: %v", m.quotas.held)
	}
}

// Attack: a create with a negative vCPU count (found by review: the API
// let it through and the manager reserved it before the sandbox's checks
// refused it) lowers the team's usage while it waits (on the volume lock,
// for one), so creates beside it pass a full quota. Expected: a negative
// or malformed need is refused (ErrInvalid) and never reserved; the quota
// still holds.
func TestQuotaNegativeNeedNeverReserved(t *testing.T) {
	m, st, team := quotaManager(t, store.TeamLimits{CPUs: 1})
	if err := createAs(m, st, team.ID, "first", sandbox.Options{CPUs: 1}); err != nil {
		t.Fatal(err)
	}
	for _, need := range []store.Usage{
		{Sandboxes: 1, CPUs: -1000}, {Sandboxes: 1, CPUs: math.NaN()}, {Sandboxes: 1, CPUs: math.Inf(-1)},
		{Sandboxes: 1, CPUs: 1, Memory: -1 << 30}, {Sandboxes: -1, CPUs: 1},
	} {
		q, err := m.reserve(team.ID, need)
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("reserve %+v: %v, want ErrInvalid", need, err)
		}
		defer q.release() // held, as by a create waiting on a lock
	}
	// While those would be held: the quota of 1 vCPU is still full.
	if err := createAs(m, st, team.ID, "second", sandbox.Options{CPUs: 1}); !errors.Is(err, ErrQuota) {
		t.Errorf("a second 1-vCPU create over a quota of 1: %v, want ErrQuota", err)
	}
	if len(m.quotas.held) != 0 {
		t.Errorf("reservations held: %v", m.quotas.held)
	}
}
