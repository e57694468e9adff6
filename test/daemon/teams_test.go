package daemontest

import (
	"net/http"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// TestAdminAPI: teams and keys through the admin routes, every answer
// validated against the OpenAPI document: a team made, listed, read with
// what it holds, its quotas and rates changed, its key made and revoked,
// and removed once it holds nothing; bad input is a 400 naming the field,
// a name taken 409, a team that holds a key or a sandbox 409 naming
// them, an unknown team or key 404. The CLI sees what the API did.
func TestAdminAPI(t *testing.T) {
	d := startDaemon(t)
	r := d.cli(t, "", "keys", "create", "--admin", "--name", "ops", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	admin := lines[len(lines)-1]
	if r.code != 0 || !keyRE.MatchString(admin) {
		t.Fatalf("cage keys create --admin: %v", r)
	}

	var team types.Team
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/admin/teams", key: admin, body: map[string]any{
		"name": "research", "quotas": map[string]any{"sandboxes": 3, "cpus": 2.5, "memoryMB": 2048}}}).decode(t, &team)
	if !strings.HasPrefix(team.TeamID, "team_") || team.Name != "research" || team.Quotas.Sandboxes != 3 || team.Quotas.MemoryMB != 2048 {
		t.Errorf("the team made: %+v", team)
	}
	for _, c := range []struct {
		body any
		want int
		text string
	}{
		{map[string]any{"name": "research"}, http.StatusConflict, "research"},
		{map[string]any{"name": "Bad Name"}, http.StatusBadRequest, "team name"},
		{map[string]any{"name": "team_x"}, http.StatusBadRequest, "team name"},
		{map[string]any{"name": "neg", "quotas": map[string]any{"cpus": -1}}, http.StatusBadRequest, ""},
		{map[string]any{"name": "huge", "quotas": map[string]any{"memoryMB": int64(1) << 50}}, http.StatusBadRequest, "memoryMB"},
		{[]byte(`{"name":`), http.StatusBadRequest, "JSON"},
	} {
		rr := d.do(t, call{method: "POST", path: "/admin/teams", key: admin, body: c.body, invalid: true})
		if rr.status != c.want || !strings.Contains(string(rr.body), c.text) {
			t.Errorf("POST /admin/teams %v: %v, want %d naming %q", c.body, rr, c.want, c.text)
		}
	}

	// A key in the team, by name; one in no team.
	var key types.CreatedAPIKey
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/admin/keys", key: admin,
		body: map[string]any{"name": "ci", "teamID": "research"}}).decode(t, &key)
	if key.TeamID != team.TeamID || key.Admin || !keyRE.MatchString(key.Key) {
		t.Errorf("the key made: %+v", key)
	}
	d.expect(t, http.StatusNotFound, call{method: "POST", path: "/admin/keys", key: admin, body: map[string]any{"teamID": "nosuch"}})
	sb := d.create(t, key.Key, nil)

	// What the team holds, and its quotas changed (rates kept).
	var got types.Team
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/teams/" + team.TeamID, key: admin}).decode(t, &got)
	if got.Usage.Sandboxes != 1 || got.Usage.MemoryMB != 512 || got.Usage.Cpus != 1 {
		t.Errorf("usage with one default sandbox: %+v", got.Usage)
	}
	d.expect(t, http.StatusOK, call{method: "PATCH", path: "/admin/teams/research", key: admin,
		body: map[string]any{"rateLimits": map[string]any{"requestsPerSecond": 50}}}).decode(t, &got)
	if got.Quotas.Sandboxes != 3 || got.RateLimits.RequestsPerSecond != 50 {
		t.Errorf("after PATCH of rates: %+v", got)
	}
	got = types.Team{}
	d.expect(t, http.StatusOK, call{method: "PATCH", path: "/admin/teams/research", key: admin,
		body: map[string]any{"quotas": map[string]any{"sandboxes": 1}}}).decode(t, &got)
	if got.Quotas.Sandboxes != 1 || got.Quotas.MemoryMB != 0 || got.RateLimits.RequestsPerSecond != 50 {
		t.Errorf("after PATCH of quotas (the whole set replaced): %+v", got)
	}
	if rr := d.do(t, call{method: "POST", path: "/v2/sandboxes", key: key.Key, body: map[string]any{"templateID": "host"}}); rr.status != http.StatusTooManyRequests ||
		!strings.Contains(string(rr.body), "quota of 1 concurrent sandboxes") {
		t.Errorf("a create over the lowered quota: %v", rr)
	}
	var teams []types.Team
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/teams", key: admin}).decode(t, &teams)
	if len(teams) != 1 || teams[0].Usage.Sandboxes != 1 {
		t.Errorf("GET /admin/teams: %+v", teams)
	}

	// Removal waits for the team to hold nothing.
	rr := d.expect(t, http.StatusConflict, call{method: "DELETE", path: "/admin/teams/research", key: admin})
	if !strings.Contains(string(rr.body), "1 keys not revoked, 1 sandboxes") {
		t.Errorf("DELETE of a team holding a key and a sandbox: %v", rr)
	}
	d.kill(t, key.Key, sb.SandboxID)
	var revoked types.APIKeyInfo
	d.expect(t, http.StatusOK, call{method: "DELETE", path: "/admin/keys/" + key.KeyID, key: admin}).decode(t, &revoked)
	if revoked.RevokedAt.IsZero() {
		t.Errorf("the revoked key: %+v", revoked)
	}
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/v2/sandboxes", key: key.Key})
	d.expect(t, http.StatusNotFound, call{method: "DELETE", path: "/admin/keys/key_000000000000", key: admin})
	var keys []types.APIKeyInfo
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/keys", key: admin}).decode(t, &keys)
	if len(keys) != 3 { // first, ops, ci
		t.Errorf("GET /admin/keys: %+v", keys)
	}
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/admin/teams/research", key: admin})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/admin/teams/research", key: admin})
	if r := d.cli(t, "", "teams", "ls", "--data", d.data); r.code != 0 || strings.Contains(r.stdout, "research") {
		t.Errorf("cage teams ls after the API removed the team: %v", r)
	}
	// The changes are the admin key's entries in the trail.
	var page types.AuditPage
	d.expect(t, http.StatusOK, call{method: "GET", path: "/audit?kind=team,key", key: admin}).decode(t, &page)
	kinds := map[string]int{}
	for _, e := range page.Entries {
		kinds[e.Kind+"/"+string(e.Source)]++
	}
	// key.create/cli: the admin key's own making, by `cage keys` on the host.
	if kinds["team.create/host"] != 1 || kinds["team.update/host"] != 2 || kinds["team.delete/host"] != 1 ||
		kinds["key.create/host"] != 1 || kinds["key.revoke/host"] != 1 || kinds["key.create/cli"] != 1 {
		t.Errorf("the admin key's trail: %v", kinds)
	}
}
