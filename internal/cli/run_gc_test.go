package cli

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestPruneIfIdle: after `cage run` destroyed its sandbox, the host
// template's stale /etc copies are pruned only when no sandbox is left
// (the GC that ran during the command saw this run's own sandbox).
func TestPruneIfIdle(t *testing.T) {
	runDir := t.TempDir()
	cache := filepath.Join(runDir, "templates", "host")
	old, cur := filepath.Join(cache, "etc-old"), filepath.Join(cache, "etc-new")
	for _, d := range []string{old, cur, filepath.Join(runDir, "sandboxes", "other")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	past := time.Now().Add(-2 * time.Minute)
	if err := os.Chtimes(old, past, past); err != nil {
		t.Fatal(err)
	}
	pruneIfIdle(runDir)
	if _, err := os.Stat(old); err != nil {
		t.Fatalf("a sandbox is alive, yet the old copy was pruned: %v", err)
	}
	if err := os.Remove(filepath.Join(runDir, "sandboxes", "other")); err != nil {
		t.Fatal(err)
	}
	pruneIfIdle(runDir)
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Errorf("no sandbox left, yet the stale copy remains (%v)", err)
	}
	if _, err := os.Stat(cur); err != nil {
		t.Errorf("the newest copy was pruned: %v", err)
	}
}
