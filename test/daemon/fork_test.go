package daemontest

import (
	"net/http"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// TestForkRoute: E2B's POST /sandboxes/{id}/fork makes count sandboxes from
// one snapshot of a running sandbox: each has its files, environment,
// metadata and wall, an identity of its own and none of its processes; the
// sandbox runs on with its id and end time, and the snapshot is gone after.
// Another key's sandbox is 404, a paused one 409, a count or timeout out of
// bounds 400; the one-line answer of a fork that could not start is in its
// entry, not in the status.
func TestForkRoute(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600, "envVars": map[string]string{"FROM": "origin"},
		"metadata": map[string]string{"role": "origin"}})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	mustRun(t, ac, "mkdir -p /home/user/work && echo v1 > /home/user/work/state && "+counter)
	before := d.get(t, d.key, id)

	var forks []types.SandboxForkResult
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/fork", key: d.key, body: map[string]any{"count": 3, "timeout": 120}}).decode(t, &forks)
	if len(forks) != 3 {
		t.Fatalf("%d results, want 3: %+v", len(forks), forks)
	}
	seen := map[string]bool{id: true}
	for i, f := range forks {
		if f.Error.Code != 0 {
			t.Errorf("fork %d: %d %s", i, f.Error.Code, f.Error.Message)
			continue
		}
		child := f.Sandbox
		d.remember(child.SandboxID, d.key)
		if seen[child.SandboxID] || child.EnvdAccessToken == sb.EnvdAccessToken || child.EnvdAccessToken == "" {
			t.Errorf("fork %d: id %s (seen %v), same token %v", i, child.SandboxID, seen[child.SandboxID], child.EnvdAccessToken == sb.EnvdAccessToken)
		}
		seen[child.SandboxID] = true
		info := d.get(t, d.key, child.SandboxID)
		if info.Wall != before.Wall || info.TemplateID != before.TemplateID || info.Metadata["role"] != "origin" {
			t.Errorf("fork %d: wall %s template %s metadata %v; origin: %s %s", i, info.Wall, info.TemplateID, info.Metadata, before.Wall, before.TemplateID)
		}
		cac := d.agent(child.SandboxID, child.EnvdAccessToken)
		out := mustRun(t, cac, "cat /home/user/work/state; echo $FROM; hostname; pgrep -f '[c]ount.new' || echo none")
		cac.Close()
		if want := "v1\norigin\ncage-" + child.SandboxID[:8] + "\nnone\n"; out != want {
			t.Errorf("fork %d: %q, want %q", i, out, want)
		}
	}
	after := d.get(t, d.key, id)
	if after.State != "running" || !after.EndAt.Equal(before.EndAt) {
		t.Errorf("the forked sandbox: state %s, end %v (was %v)", after.State, after.EndAt, before.EndAt)
	}
	c1 := count(t, mustRun(t, ac, "cat /tmp/count"))
	if c2 := count(t, mustRun(t, ac, "sleep 0.5; cat /tmp/count")); c2 <= c1 {
		t.Errorf("the forked sandbox's processes stopped: %d then %d", c1, c2)
	}
	var listed []types.SnapshotInfo
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots?sandboxID=" + id, key: d.key}).decode(t, &listed)
	if len(listed) != 0 {
		t.Errorf("the fork's snapshot is still listed: %+v", listed)
	}

	// No body: one fork.
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/fork", key: d.key}).decode(t, &forks)
	if len(forks) != 1 || forks[0].Error.Code != 0 {
		t.Errorf("fork without a body: %+v", forks)
	} else {
		d.remember(forks[0].Sandbox.SandboxID, d.key)
		d.kill(t, d.key, forks[0].Sandbox.SandboxID)
	}

	for _, body := range []map[string]any{{"count": -1}, {"count": 101}, {"timeout": -5}, {"timeout": 999999999}} {
		d.expect(t, http.StatusBadRequest, call{method: "POST", path: path + "/fork", key: d.key, body: body, invalid: true})
	}
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: path + "/fork", key: d.key, body: []byte(`{"count":`), invalid: true})
	d.expect(t, http.StatusNotFound, call{method: "POST", path: path + "/fork", key: d.createKey(t, "stranger")})
	d.expect(t, http.StatusNotFound, call{method: "POST", path: "/sandboxes/nosuchsandbox/fork", key: d.key})
	d.expect(t, http.StatusUnauthorized, call{method: "POST", path: path + "/fork"})

	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
	d.expect(t, http.StatusConflict, call{method: "POST", path: path + "/fork", key: d.key})
	if n := len(d.list(t, d.key, nil)); n != 1+3 {
		t.Errorf("%d sandboxes after the refused forks, want %d", n, 1+3)
	}
}

// TestLifecycleCLI: cage pause, resume, snapshot and fork as a user types
// them, and their one-line refusals.
func TestLifecycleCLI(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600})
	id := sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	mustRun(t, ac, "echo kept > /home/user/kept")
	ac.Close()

	if r := d.cli(t, d.key, "pause", id); r.code != 0 || r.stdout != id+"\n" {
		t.Fatalf("cage pause: %v", r)
	}
	if got := d.get(t, d.key, id); got.State != "paused" {
		t.Errorf("after cage pause: state %s", got.State)
	}
	r := d.cli(t, d.key, "pause", id)
	if r.code == 0 {
		t.Errorf("cage pause of a paused sandbox: %v", r)
	}
	oneLine(t, "cage pause of a paused sandbox", r.stderr, "paused")
	if r := d.cli(t, d.key, "resume", "--timeout", "10m", id); r.code != 0 || r.stdout != id+"\n" {
		t.Fatalf("cage resume: %v", r)
	}
	if got := d.get(t, d.key, id); got.State != "running" {
		t.Errorf("after cage resume: state %s", got.State)
	}
	if r := d.cli(t, d.key, "snapshot", "--name", "cli-snap", id); r.code != 0 || r.stdout != "cage/cli-snap:default\n" {
		t.Errorf("cage snapshot: %v", r)
	}
	r = d.cli(t, d.key, "fork", "-n", "2", "--timeout", "2m", id)
	forks := strings.Fields(r.stdout)
	if r.code != 0 || len(forks) != 2 {
		t.Fatalf("cage fork -n 2: %v", r)
	}
	for _, f := range forks {
		d.remember(f, d.key)
		if got := d.get(t, d.key, f); got.State != "running" || got.TemplateID != "host" {
			t.Errorf("fork %s: state %s template %s", f, got.State, got.TemplateID)
		}
	}
	for _, bad := range [][]string{{"fork", "-n", "0", id}, {"fork", "--timeout", "0s", id}, {"resume", "--timeout", "soon", id}} {
		r := d.cli(t, d.key, bad...)
		if r.code != 64 {
			t.Errorf("cage %v: %v, want exit 64", bad, r)
		}
		oneLine(t, "cage "+strings.Join(bad, " "), r.stderr)
	}
	r = d.cli(t, d.key, "fork", "nosuchsandbox")
	if r.code == 0 {
		t.Errorf("cage fork of an unknown sandbox: %v", r)
	}
	oneLine(t, "cage fork of an unknown sandbox", r.stderr, "nosuchsandbox")
}
