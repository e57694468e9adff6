package daemontest

import (
	"net/http"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// Attack (a tenant within its quotas): a team with a disk and a memory
// quota runs a sandbox on a wall that checkpoints (gVisor), fills its
// memory and pauses it with memory: the checkpoint, up to its memory,
// goes to the host's data directory, and its memory leaves the team's
// memory quota, so the team starts another, fills it, pauses it, and on.
// The checkpoints counted against nothing: the team's disk quota counted
// each paused sandbox's disk only. Expected: a checkpointed sandbox's
// memory counts in its team's disk usage; a pause with memory that the
// disk quota has no room for is 429 naming the disk quota (the sandbox
// runs on), while a pause with its files still fits; a resume gives the
// bytes back.
func TestCheckpointsCountAgainstDiskQuota(t *testing.T) {
	t.Parallel()
	if _, ok := checkpointWalls(t)["gvisor"]; !ok {
		return
	}
	d := startDaemon(t)
	if r := d.cli(t, "", "teams", "create", "alpha", "--disk", "600M", "--data", d.data); r.code != 0 {
		t.Fatalf("cage teams create: %v", r)
	}
	r := d.cli(t, "", "keys", "create", "--team", "alpha", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	alpha := lines[len(lines)-1]
	if r.code != 0 || !keyRE.MatchString(alpha) {
		t.Fatalf("cage keys create --team alpha: %v", r)
	}
	admin := d.cli(t, "", "keys", "create", "--admin", "--name", "ops", "--data", d.data)
	al := strings.Split(strings.TrimSpace(admin.stdout), "\n")
	diskMB := func() int64 {
		var team types.Team
		d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/teams/alpha", key: al[len(al)-1]}).decode(t, &team)
		return int64(team.Usage.DiskMB)
	}
	body := map[string]any{"wall": "gvisor", "timeout": 600, "memoryMB": 256, "diskSizeMB": 128}
	a := d.create(t, alpha, body)
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + a.SandboxID + "/pause", key: alpha, body: map[string]any{}})
	if got := d.get(t, alpha, a.SandboxID); got.PausedWith != "checkpoint" {
		t.Fatalf("paused with %q, want checkpoint", got.PausedWith)
	}
	if got := diskMB(); got != 128+256 {
		t.Errorf("the team's disk usage with one sandbox checkpointed: %d MiB, want its disk's 128 and its memory's 256", got)
	}
	// 384 + 128 of 600 MiB: another sandbox fits; its checkpoint does not.
	b := d.create(t, alpha, body)
	over := d.do(t, call{method: "POST", path: "/sandboxes/" + b.SandboxID + "/pause", key: alpha, body: map[string]any{}})
	if over.status != http.StatusTooManyRequests || !strings.Contains(string(over.body), "disk") {
		t.Errorf("a checkpoint past the team's disk quota: %v; want 429 naming the disk quota", over)
	}
	if got := d.get(t, alpha, b.SandboxID); got.State != "running" {
		t.Errorf("after the refused pause: %q, want running", got.State)
	}
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + b.SandboxID + "/pause", key: alpha, body: map[string]any{"memory": false}})
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + a.SandboxID + "/connect", key: alpha, body: map[string]any{"timeout": 600}})
	if got := diskMB(); got != 128+128 {
		t.Errorf("the team's disk usage after the resume: %d MiB, want its two disks' 256", got)
	}
	d.kill(t, alpha, a.SandboxID)
	d.kill(t, alpha, b.SandboxID)
}
