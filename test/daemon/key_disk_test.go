package daemontest

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Attack (any key without a team): pause sandbox after sandbox, and
// snapshot them, each pause and snapshot an archive in the host's data
// directory. Such a key had no quota, so its archives were bounded only by
// the host's free space, which it could fill for every tenant (their
// pauses, snapshots, volumes and the store). Expected: with
// limits.key_disk at 300M, two pauses of sandboxes with 128 MiB disks fit
// and a third is 429 naming the disk (the sandbox runs on), as is a
// snapshot of files more than the bound has left (nothing left in the
// data directory); killing a paused sandbox gives its bytes back.
func TestKeyWithoutTeamBoundOnDisk(t *testing.T) {
	t.Parallel()
	cfg := filepath.Join(t.TempDir(), "cage.json")
	b, _ := json.Marshal(map[string]any{"limits": map[string]any{"key_disk": "300M"}})
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--config", cfg)
	body := map[string]any{"timeout": 600, "diskSizeMB": 128}
	pause := func(id string) reply {
		return d.do(t, call{method: "POST", path: "/sandboxes/" + id + "/pause", key: d.key, body: map[string]any{"memory": false}})
	}
	var ids []string
	for i := 0; i < 3; i++ {
		ids = append(ids, d.create(t, d.key, body).SandboxID)
	}
	for _, id := range ids[:2] {
		if r := pause(id); r.status != http.StatusNoContent {
			t.Fatalf("a pause within the key's bound: %v", r)
		}
	}
	if r := pause(ids[2]); r.status != http.StatusTooManyRequests || !strings.Contains(string(r.body), "disk") {
		t.Errorf("a pause past the key's bound on the disk: %v; want 429 naming the disk", r)
	} else if got := d.get(t, d.key, ids[2]); got.State != "running" {
		t.Errorf("after the refused pause: %q, want running", got.State)
	}
	// 44 MiB left: a snapshot of 60 MB of files does not fit.
	ac := d.agent(ids[2], d.get(t, d.key, ids[2]).EnvdAccessToken)
	mustRun(t, ac, "head -c 60000000 /dev/urandom > /tmp/blob")
	ac.Close()
	over := d.do(t, call{method: "POST", path: "/sandboxes/" + ids[2] + "/snapshots", key: d.key, body: map[string]any{}})
	if over.status != http.StatusTooManyRequests || !strings.Contains(string(over.body), "disk") {
		t.Errorf("a snapshot past the key's bound on the disk: %v; want 429 naming the disk", over)
	}
	if ents, _ := os.ReadDir(filepath.Join(d.data, "snapshots")); len(ents) != 0 {
		t.Errorf("after the refused snapshot: %d files in the data directory, want none", len(ents))
	}
	d.kill(t, d.key, ids[0])
	if r := pause(ids[2]); r.status != http.StatusNoContent {
		t.Errorf("a pause once a paused sandbox was killed: %v", r)
	}
	d.kill(t, d.key, ids[1])
	d.kill(t, d.key, ids[2])
}
