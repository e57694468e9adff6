package daemontest

import (
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// Attack (a tenant within its quotas): a team with a disk quota runs one
// small sandbox, writes some files and snapshots it again and again. Each
// snapshot is an archive of the sandbox's files in the host's data
// directory, and none counted against the team's disk quota: the team
// filled the host's disk (its volumes, the store, other tenants' pauses
// and snapshots) one snapshot at a time, within every quota it had.
// Expected: a team's snapshots take their bytes of its disk quota; one
// past it is 429 naming the disk quota and leaves no file; deleting a
// snapshot gives its bytes back; the team's usage shows them.
func TestSnapshotsCountAgainstDiskQuota(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	if r := d.cli(t, "", "teams", "create", "alpha", "--disk", "100M", "--data", d.data); r.code != 0 {
		t.Fatalf("cage teams create: %v", r)
	}
	r := d.cli(t, "", "keys", "create", "--team", "alpha", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	alpha := lines[len(lines)-1]
	if r.code != 0 || !keyRE.MatchString(alpha) {
		t.Fatalf("cage keys create --team alpha: %v", r)
	}
	sb := d.create(t, alpha, map[string]any{"timeout": 600, "diskSizeMB": 64})
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	mustRun(t, ac, "head -c 20000000 /dev/urandom > /tmp/blob")
	ac.Close()
	path := "/sandboxes/" + sb.SandboxID + "/snapshots"
	snapshots := func() int {
		ents, _ := os.ReadDir(filepath.Join(d.data, "snapshots"))
		return len(ents)
	}

	// 64 MiB of the sandbox's disk and 100 MiB of quota: one snapshot of
	// some 20 MB fits, a second does not.
	var first types.SnapshotInfo
	d.expect(t, http.StatusCreated, call{method: "POST", path: path, key: alpha, body: map[string]any{}}).decode(t, &first)
	over := d.do(t, call{method: "POST", path: path, key: alpha, body: map[string]any{}})
	if over.status != http.StatusTooManyRequests || !strings.Contains(string(over.body), "disk") {
		n := 1
		for ; n < 6 && over.status == http.StatusCreated; n++ {
			over = d.do(t, call{method: "POST", path: path, key: alpha, body: map[string]any{}})
		}
		t.Fatalf("snapshots past the team's disk quota: %d made (%d archives in the data directory), then %v; want the second refused with 429 naming the disk quota",
			n, snapshots(), over)
	}
	if n := snapshots(); n != 1 {
		t.Errorf("after the refused snapshot: %d files in the data directory, want 1", n)
	}
	var team types.Team
	admin := d.cli(t, "", "keys", "create", "--admin", "--name", "ops", "--data", d.data)
	al := strings.Split(strings.TrimSpace(admin.stdout), "\n")
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/teams/alpha", key: al[len(al)-1]}).decode(t, &team)
	if team.Usage.DiskMB < 64+19 {
		t.Errorf("the team's disk usage: %d MiB, want its sandbox's 64 and its snapshot's some 20", team.Usage.DiskMB)
	}

	// Its bytes come back with it.
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/templates/" + url.PathEscape(first.SnapshotID), key: alpha})
	d.expect(t, http.StatusCreated, call{method: "POST", path: path, key: alpha, body: map[string]any{"name": "again"}})
	d.kill(t, alpha, sb.SandboxID)
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/templates/" + url.PathEscape("cage/again:default"), key: alpha})
}
