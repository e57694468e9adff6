package daemontest

import (
	"encoding/json"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil"
)

// TestDurableLeakCheck is the leak check of durable state, on every wall:
// cycles of pause with memory and resume, pause without memory and resume,
// a snapshot and a sandbox started from it, a fork of two, and the
// snapshot's deletion, each sandbox killed at the end. Afterwards nothing
// is left: no sandbox listed, no state directory or cgroup of any sandbox
// the cycles made, no saved files, checkpoints or snapshot archives in the
// data directory, no sandbox state directory at all.
func TestDurableLeakCheck(t *testing.T) {
	t.Parallel()
	cfg := map[string]any{"network": map[string]any{"dns": testutil.SharedWorld(t).Upstreams()}}
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		cfg["templates"] = dir
	}
	p := filepath.Join(t.TempDir(), "config.json")
	b, _ := json.Marshal(cfg)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--config", p)
	for _, w := range []string{"process", "runc", "gvisor", "microvm"} {
		tmpl, cycles := "host", 3
		switch {
		case w == "microvm" && cfg["templates"] == nil:
			if testutil.WallRequired(w) {
				t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but CAGE_TEMPLATES names no template store", w)
			}
			t.Logf("SKIP wall %s: no template store (CAGE_TEMPLATES)", w)
			continue
		case !wallHere(w):
			if testutil.WallRequired(w) {
				t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but is not on this host", w)
			}
			t.Logf("SKIP wall %s: not on this host", w)
			continue
		case w == "microvm":
			tmpl, cycles = "base", 1 // each VM booted under TCG
		}
		var made []string
		for i := 0; i < cycles && !t.Failed(); i++ {
			made = append(made, d.durableCycle(t, w, tmpl)...)
		}
		if t.Failed() {
			t.Fatalf("the %s wall's cycles failed (the daemon's log follows)", w)
		}
		for _, id := range made {
			d.checkGone(t, id, 10*time.Second)
		}
		t.Logf("%s: %d cycles, %d sandboxes made and killed", w, cycles, len(made))
	}
	if left := d.list(t, d.key, url.Values{"state": {"running,paused"}}); len(left) > 0 {
		t.Errorf("%d sandboxes still listed", len(left))
	}
	for _, dir := range []string{"paused", "snapshots", "checkpoints"} {
		if left, _ := filepath.Glob(filepath.Join(d.data, dir, "*")); len(left) > 0 {
			t.Errorf("left in DATA/%s: %v", dir, left)
		}
	}
	if left := d.sandboxDirs(); len(left) > 0 {
		t.Errorf("left in RUN_DIR/sandboxes: %v", left)
	}
}

// durableCycle runs one cycle on wall w and returns the ids it made.
func (d *daemon) durableCycle(t *testing.T, w, tmpl string) []string {
	t.Helper()
	sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 600})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	made := []string{id}
	defer func() {
		for _, m := range made {
			d.do(t, call{method: "DELETE", path: "/sandboxes/" + m, key: d.key})
		}
	}()
	ac := d.agent(id, sb.EnvdAccessToken)
	mustRun(t, ac, "echo cycle > /home/user/cycle && "+counter)
	ac.Close()
	for _, memory := range []bool{true, false} {
		d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{"memory": memory}})
		d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 600}})
	}
	ac = d.agent(id, sb.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /home/user/cycle"); out != "cycle\n" {
		t.Errorf("%s: after the pauses: %q", w, out)
	}
	ac.Close()
	var sn types.SnapshotInfo
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/snapshots", key: d.key, body: map[string]any{}}).decode(t, &sn)
	child := d.create(t, d.key, map[string]any{"templateID": sn.SnapshotID, "wall": w, "timeout": 120})
	made = append(made, child.SandboxID)
	var forks []types.SandboxForkResult
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/fork", key: d.key, body: map[string]any{"count": 2, "timeout": 120}}).decode(t, &forks)
	for i, f := range forks {
		if f.Error.Code != 0 {
			t.Errorf("%s: fork %d: %d %s", w, i, f.Error.Code, f.Error.Message)
			continue
		}
		d.remember(f.Sandbox.SandboxID, d.key)
		made = append(made, f.Sandbox.SandboxID)
	}
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/templates/" + url.PathEscape(sn.SnapshotID), key: d.key})
	return made
}
