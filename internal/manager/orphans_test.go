package manager

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
)

// A crash between an archive's rename and its record (a snapshot's
// insert, a pause's update), or a sandbox paused as the daemon died and
// lost with the host, left its archive in the data directory for good: up
// to a sandbox's disk and a quarter, named by no record, counted in no
// quota, removed by nothing. Expected: the daemon's start removes the
// archives no record names and keeps those of paused sandboxes and of
// snapshots (one named like the orphan's id included).
func TestRecoverRemovesOrphanArchives(t *testing.T) {
	data := t.TempDir()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m := New(Config{Store: st, Data: data})
	const paused, running, gone = "0123456789abcdef0001", "0123456789abcdef0002", "0123456789abcdef0003"
	for _, rec := range []*store.Sandbox{
		{ID: paused, KeyID: "k", State: store.StatePaused, PauseKind: PauseFiles, NetSlot: -1, StartedAt: time.Now(), EndAt: time.Now()},
		{ID: running, KeyID: "k", State: store.StateRunning, NetSlot: -1, StartedAt: time.Now(), EndAt: time.Now()},
	} {
		if err := st.InsertSandbox(rec); err != nil {
			t.Fatal(err)
		}
	}
	const kept, orphan = "snapkept00000000000000", "snaporphan000000000000"
	for _, sn := range []*store.Snapshot{
		{ID: kept, KeyID: "k", Kind: PauseFiles, CreatedAt: time.Now()},
		{ID: "snapother0000000000000", KeyID: "k", Name: orphan, Kind: PauseFiles, CreatedAt: time.Now()},
	} {
		if err := st.InsertSnapshot(sn); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]bool{ // path -> kept
		m.savedFiles(paused): true, m.savedFiles(running): false, m.savedFiles(gone): false,
		m.snapshotFile(kept): true, m.snapshotFile(orphan): false,
		filepath.Join(data, "snapshots", "notes.txt"): true,
	}
	for p := range files {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m.removeOrphanArchives()
	for p, keep := range files {
		_, err := os.Stat(p)
		if keep && err != nil {
			t.Errorf("%s: removed (%v), want it kept", filepath.Base(p), err)
		}
		if !keep && err == nil {
			t.Errorf("%s: left, want it removed: no record names it", filepath.Base(p))
		}
	}
}
