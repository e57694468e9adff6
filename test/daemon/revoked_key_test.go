package daemontest

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// Revoking a key without a team: nobody can reach what it owned any more
// (it was their only owner). Its snapshots and volumes stayed on the
// host's disk for good, owned by nobody who could list or delete them,
// and its sandboxes ran on to their end. Expected: within a sweep or a
// few, its running and paused sandboxes, its snapshot and its volume
// (mounted by one of them) are gone from the host; a team's key revoked
// removes nothing of the team's.
func TestRevokedKeyTakesItsOwn(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	key := d.createKey(t, "leaving")
	if r := d.cli(t, "", "teams", "create", "stays", "--data", d.data); r.code != 0 {
		t.Fatalf("cage teams create: %v", r)
	}
	r := d.cli(t, "", "keys", "create", "--team", "stays", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	teamKey := lines[len(lines)-1]
	if r.code != 0 || !keyRE.MatchString(teamKey) {
		t.Fatalf("cage keys create --team stays: %v", r)
	}
	var vol, teamVol types.VolumeAndToken
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/volumes", key: key, body: map[string]any{"name": "v"}}).decode(t, &vol)
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/volumes", key: teamKey, body: map[string]any{"name": "v"}}).decode(t, &teamVol)
	running := d.create(t, key, map[string]any{"timeout": 600,
		"volumeMounts": []map[string]string{{"name": "v", "path": "/mnt/v"}}})
	paused := d.create(t, key, map[string]any{"timeout": 600})
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + paused.SandboxID + "/pause", key: key, body: map[string]any{"memory": false}})
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/sandboxes/" + running.SandboxID + "/snapshots", key: key, body: map[string]any{}})
	for _, k := range []string{key, teamKey} {
		if r := d.cli(t, "", "keys", "revoke", k[:len("e2b_")+8], "--data", d.data); r.code != 0 {
			t.Fatalf("cage keys revoke: %v", r)
		}
	}
	left := func() []string {
		var out []string
		for _, p := range []string{
			filepath.Join(d.runDir, "sandboxes", running.SandboxID),
			filepath.Join(d.data, "volumes", vol.VolumeID),
		} {
			if _, err := os.Stat(p); err == nil {
				out = append(out, p)
			}
		}
		for _, dir := range []string{"paused", "snapshots"} {
			ents, _ := os.ReadDir(filepath.Join(d.data, dir))
			for _, e := range ents {
				out = append(out, filepath.Join(dir, e.Name()))
			}
		}
		return out
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(left()) > 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if l := left(); len(l) > 0 {
		t.Errorf("30 s after its key was revoked, what it owned is left: %v", l)
	}
	if _, err := os.Stat(filepath.Join(d.data, "volumes", teamVol.VolumeID)); err != nil {
		t.Errorf("the team's volume after one of its keys was revoked: %v", err)
	}
}
