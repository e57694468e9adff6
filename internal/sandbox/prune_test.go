package sandbox

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestPruneIfIdle: the shared read-only copies (the host template's /etc,
// the agent's binary) are pruned down to the newest of each only when no
// sandbox is left (`cage run` calls it after destroying its own sandbox,
// the GC that ran during the command having seen that sandbox alive); the
// copies' lock file stays.
func TestPruneIfIdle(t *testing.T) {
	runDir := t.TempDir()
	etc, agents := filepath.Join(runDir, "templates", "host"), filepath.Join(runDir, "agents")
	oldEtc, curEtc := filepath.Join(etc, "etc-old"), filepath.Join(etc, "etc-new")
	oldAgent, curAgent := filepath.Join(agents, "agent-1-2-3"), filepath.Join(agents, "cage-agent-4-5-6")
	for _, d := range []string{oldEtc, curEtc, oldAgent, curAgent, filepath.Join(runDir, "sandboxes", "other")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	lock := filepath.Join(agents, ".lock")
	if err := os.WriteFile(lock, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-2 * time.Minute)
	for _, p := range []string{oldEtc, oldAgent, lock} {
		if err := os.Chtimes(p, past, past); err != nil {
			t.Fatal(err)
		}
	}
	PruneIfIdle(runDir)
	for _, p := range []string{oldEtc, oldAgent} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("a sandbox is alive, yet %s was pruned: %v", p, err)
		}
	}
	if err := os.Remove(filepath.Join(runDir, "sandboxes", "other")); err != nil {
		t.Fatal(err)
	}
	PruneIfIdle(runDir)
	for _, p := range []string{oldEtc, oldAgent} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("no sandbox left, yet the stale copy %s remains (%v)", p, err)
		}
	}
	for _, p := range []string{curEtc, curAgent, lock} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s was pruned: %v", p, err)
		}
	}
}
