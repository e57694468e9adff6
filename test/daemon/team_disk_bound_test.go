package daemontest

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Attack (a team's key, its team given quotas but no disk quota, or none
// at all): pause sandbox after sandbox, and snapshot them. A key without a
// team is held to limits.key_disk on the host's disk; a team without a
// disk quota was held to nothing, so its pauses' and snapshots' archives
// could fill the host's disk for every tenant. Expected: such a team is
// held to limits.key_disk as a whole, as a key without a team is: with
// 300M, two pauses of 128 MiB disks fit and a third is 429 naming the
// disk (the sandbox runs on), as is a snapshot past what is left (no file
// left); a team with a disk quota is held to its quota instead.
func TestTeamWithoutDiskQuotaBoundOnDisk(t *testing.T) {
	t.Parallel()
	cfg := filepath.Join(t.TempDir(), "cage.json")
	b, _ := json.Marshal(map[string]any{"limits": map[string]any{"key_disk": "300M"}})
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--config", cfg)
	key := func(team string, quota ...string) string {
		t.Helper()
		if r := d.cli(t, "", append([]string{"teams", "create", team, "--data", d.data}, quota...)...); r.code != 0 {
			t.Fatalf("cage teams create %s: %v", team, r)
		}
		r := d.cli(t, "", "keys", "create", "--team", team, "--data", d.data)
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		k := lines[len(lines)-1]
		if r.code != 0 || !keyRE.MatchString(k) {
			t.Fatalf("cage keys create --team %s: %v", team, r)
		}
		return k
	}
	alpha := key("alpha", "--sandboxes", "10")
	body := map[string]any{"timeout": 600, "diskSizeMB": 128}
	pause := func(k, id string) reply {
		return d.do(t, call{method: "POST", path: "/sandboxes/" + id + "/pause", key: k, body: map[string]any{"memory": false}})
	}
	var ids []string
	for i := 0; i < 3; i++ {
		ids = append(ids, d.create(t, alpha, body).SandboxID)
	}
	for _, id := range ids[:2] {
		if r := pause(alpha, id); r.status != http.StatusNoContent {
			t.Fatalf("a pause within the bound: %v", r)
		}
	}
	if r := pause(alpha, ids[2]); r.status != http.StatusTooManyRequests || !strings.Contains(string(r.body), "disk") {
		t.Errorf("a pause past the bound on the disk of a team without a disk quota: %v; want 429 naming the disk", r)
	} else if got := d.get(t, alpha, ids[2]); got.State != "running" {
		t.Errorf("after the refused pause: %q, want running", got.State)
	}
	ac := d.agent(ids[2], d.get(t, alpha, ids[2]).EnvdAccessToken)
	mustRun(t, ac, "head -c 60000000 /dev/urandom > /tmp/blob")
	ac.Close()
	over := d.do(t, call{method: "POST", path: "/sandboxes/" + ids[2] + "/snapshots", key: alpha, body: map[string]any{}})
	if over.status != http.StatusTooManyRequests || !strings.Contains(string(over.body), "disk") {
		t.Errorf("a snapshot past the bound on the disk of a team without a disk quota: %v; want 429 naming the disk", over)
	}
	if ents, _ := os.ReadDir(filepath.Join(d.data, "snapshots")); len(ents) != 0 {
		t.Errorf("after the refused snapshot: %d files in the data directory, want none", len(ents))
	}
	d.kill(t, alpha, ids[0])
	if r := pause(alpha, ids[2]); r.status != http.StatusNoContent {
		t.Errorf("a pause once a paused sandbox was killed: %v", r)
	}

	// A team with a disk quota is held to it, not to key_disk: 600 MiB
	// of quota takes three paused 128 MiB sandboxes (and their disks).
	beta := key("beta", "--disk", "600M")
	var bids []string
	for i := 0; i < 3; i++ {
		bids = append(bids, d.create(t, beta, body).SandboxID)
	}
	for _, id := range bids {
		if r := pause(beta, id); r.status != http.StatusNoContent {
			t.Errorf("a pause within the team's disk quota, past key_disk: %v", r)
		}
	}
	for _, id := range ids[1:] {
		d.kill(t, alpha, id)
	}
	for _, id := range bids {
		d.kill(t, beta, id)
	}
}
