package store

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestTeams(t *testing.T) {
	s := openTest(t, t.TempDir())
	lim := TeamLimits{Sandboxes: 3, CPUs: 2, Memory: 1 << 30, Paused: 1, Requests: 5}
	a, err := s.CreateTeam("alpha", lim)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(a.ID, TeamPrefix) || len(a.ID) != len(TeamPrefix)+12 || a.Name != "alpha" || a.Limits != lim {
		t.Fatalf("team %+v", a)
	}
	if _, err := s.CreateTeam("alpha", TeamLimits{}); !errors.Is(err, ErrConflict) {
		t.Errorf("same name again: %v, want ErrConflict", err)
	}
	for _, bad := range []string{"", "Alpha", "-a", "a b", "team_x", strings.Repeat("a", 64), "a/b"} {
		if _, err := s.CreateTeam(bad, TeamLimits{}); err == nil {
			t.Errorf("name %q accepted", bad)
		}
	}
	if _, err := s.CreateTeam("neg", TeamLimits{CPUs: -1}); err == nil {
		t.Error("a negative quota accepted")
	}
	for _, ref := range []string{a.ID, "alpha"} {
		if got, err := s.GetTeam(ref); err != nil || got.ID != a.ID || got.Limits != lim {
			t.Errorf("GetTeam(%q) = %+v, %v", ref, got, err)
		}
	}
	if _, err := s.GetTeam("beta"); !errors.Is(err, ErrNotFound) {
		t.Errorf("GetTeam(beta) = %v", err)
	}
	lim.Sandboxes = 5
	if err := s.SetTeamLimits(a.ID, lim); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.GetTeam(a.ID); got.Limits.Sandboxes != 5 {
		t.Errorf("limits after SetTeamLimits: %+v", got.Limits)
	}
	if err := s.SetTeamLimits("team_000000000000", lim); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetTeamLimits of no team: %v", err)
	}

	// Keys: in a team, as admin; a team that does not exist is refused.
	plain, k, err := s.CreateKeyWith(KeyOptions{Name: "ci", TeamID: a.ID})
	if err != nil {
		t.Fatal(err)
	}
	if k.TeamID != a.ID || k.Admin || k.Owner() != a.ID {
		t.Errorf("team key %+v owner %s", k, k.Owner())
	}
	got, err := s.VerifyKey(plain)
	if err != nil || got.TeamID != a.ID || got.Owner() != a.ID {
		t.Errorf("VerifyKey = %+v, %v", got, err)
	}
	_, adm, err := s.CreateKeyWith(KeyOptions{Name: "ops", Admin: true})
	if err != nil || !adm.Admin || adm.Owner() != adm.ID {
		t.Fatalf("admin key %+v %v", adm, err)
	}
	if _, _, err := s.CreateKeyWith(KeyOptions{TeamID: "team_ffffffffffff"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("key in no team: %v, want ErrNotFound", err)
	}
	// An admin key is no tenant of any team: in one, its changes to the
	// other teams and keys were in that team's audit trail.
	if _, k, err := s.CreateKeyWith(KeyOptions{Name: "ops", Admin: true, TeamID: a.ID}); !errors.Is(err, ErrAdminInTeam) {
		t.Errorf("an admin key in team %s: %+v %v, want ErrAdminInTeam", a.ID, k, err)
	}
	keys, _ := s.ListKeys()
	if len(keys) != 2 {
		t.Errorf("keys %d, want 2 (the refused one made none)", len(keys))
	}

	// A team that holds something is not removed, and says what it holds.
	if err := s.InsertSandbox(&Sandbox{ID: "sb1", KeyID: a.ID, State: StateRunning, StartedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	err = s.DeleteTeam(a.ID)
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "1 keys not revoked, 1 sandboxes") {
		t.Errorf("DeleteTeam with a key and a sandbox: %v", err)
	}
	if _, err := s.RevokeKey(k.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSandbox("sb1"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteTeam(a.ID); err != nil {
		t.Fatalf("DeleteTeam of an empty team: %v", err)
	}
	if err := s.DeleteTeam(a.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("DeleteTeam again: %v", err)
	}
	if ts, _ := s.ListTeams(); len(ts) != 0 {
		t.Errorf("teams left: %v", ts)
	}
}

func TestUsage(t *testing.T) {
	s := openTest(t, t.TempDir())
	now := time.Now()
	for _, sb := range []*Sandbox{
		{ID: "r1", KeyID: "team_a", State: StateRunning, CPUs: 1, Memory: 256 << 20, Disk: 100 << 20},
		{ID: "r2", KeyID: "team_a", State: StateCreating, CPUs: 0.5, Memory: 128 << 20, Disk: 50 << 20},
		{ID: "p1", KeyID: "team_a", State: StatePaused, PauseKind: "memory", CPUs: 2, Memory: 512 << 20, Disk: 10 << 20},
		{ID: "p2", KeyID: "team_a", State: StatePaused, PauseKind: "files", CPUs: 2, Memory: 1024 << 20, Disk: 20 << 20},
		// A checkpoint holds its memory on the host's disk, not in RAM.
		{ID: "p3", KeyID: "team_a", State: StatePaused, PauseKind: PauseCheckpoint, CPUs: 2, Memory: 300 << 20, Disk: 5 << 20},
		{ID: "o1", KeyID: "key_b", State: StateRunning, CPUs: 4, Memory: 4096 << 20, Disk: 1 << 30},
	} {
		sb.StartedAt = now
		if err := s.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	u, err := s.Usage("team_a", "memory")
	if err != nil {
		t.Fatal(err)
	}
	want := Usage{Sandboxes: 2, CPUs: 1.5, Memory: (256 + 128 + 512) << 20, Disk: (180 + 5 + 300) << 20, Paused: 3}
	if u != want {
		t.Errorf("usage %+v, want %+v", u, want)
	}
	// On the host's disk: the paused sandboxes' disks and the checkpoint's memory.
	if kept, err := s.KeptOnDisk("team_a"); err != nil || kept != (10+20+5+300)<<20 {
		t.Errorf("kept on disk: %d MiB %v, want 335", kept>>20, err)
	}
	if u, _ := s.Usage("nobody"); u != (Usage{}) {
		t.Errorf("usage of nobody %+v", u)
	}
	cs, err := s.SandboxCounts()
	if err != nil || len(cs) != 4 { // the three paused of team_a are one group
		t.Fatalf("counts %+v %v", cs, err)
	}
}
