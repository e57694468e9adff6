package sandbox

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// TestGCBesideRun: a run's GC collects a dead sandbox's state every time,
// and does the host-wide scans (uid-range locks, the network's links and
// rules) when it found one, when the run directory has had none for
// fullGCEvery, and not otherwise; the daemon's GC always does them.
func TestGCBesideRun(t *testing.T) {
	testutil.RequireRoot(t)
	runDir := testutil.RunDir(t)
	// (GC starts no agent: any executable will do for its path.)
	h, err := NewHost(runDir, "/bin/true", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	step := func(what string, gc func(), want int64) {
		t.Helper()
		gc()
		if got := h.fullGCs.Load(); got != want {
			t.Fatalf("%s: %d full GCs in all, want %d", what, got, want)
		}
	}
	step("a fresh run directory", h.GCBesideRun, 1)
	stamp := filepath.Join(runDir, fullGCStamp)
	if fi, err := os.Stat(stamp); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("no stamp after a full GC: %v", err)
	}
	step("the next run, nothing dead", h.GCBesideRun, 1)

	dead := filepath.Join(runDir, "sandboxes", "0123456789abcdef0123")
	if err := os.MkdirAll(dead, 0o700); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-time.Minute)
	if err := os.Chtimes(dead, old, old); err != nil {
		t.Fatal(err)
	}
	step("a run that finds a dead sandbox", h.GCBesideRun, 2)
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("the dead sandbox's state is still there: %v", err)
	}
	step("the next run", h.GCBesideRun, 2)

	stale := time.Now().Add(-fullGCEvery - time.Second)
	if err := os.Chtimes(stamp, stale, stale); err != nil {
		t.Fatal(err)
	}
	step("a run after fullGCEvery", h.GCBesideRun, 3)
	step("the daemon's GC", h.GC, 4)
	step("the daemon's GC again", h.GC, 5)
}
