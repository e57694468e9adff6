package abuse

import (
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/apispec"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// newTeam makes a team on the daemon's host (`cage teams create`).
func newTeam(t *testing.T, d *cageserve.Daemon, name string, flags ...string) {
	t.Helper()
	out, errb, err := d.Cage(append([]string{"teams", "create", name, "--data", d.Data}, flags...)...)
	if err != nil || !strings.HasPrefix(string(out), "team_") {
		t.Fatalf("cage teams create %s: %v: %s %s", name, err, out, errb)
	}
}

// sandboxRoutes are the API's routes that name a sandbox, as the OpenAPI
// document lists them (a route added later is covered).
func sandboxRoutes(t *testing.T) []string {
	t.Helper()
	doc, err := apispec.Doc()
	if err != nil {
		t.Fatal(err)
	}
	var routes []string
	for path, item := range doc.Paths.Map() {
		if !strings.Contains(path, "{sandboxID}") {
			continue
		}
		for method := range item.Operations() {
			routes = append(routes, method+" "+path)
		}
	}
	sort.Strings(routes)
	if len(routes) < 8 {
		t.Fatalf("the document lists %d sandbox routes; the matrix would prove little: %v", len(routes), routes)
	}
	return routes
}

// noneOfIt checks that key gets, on every sandbox route, the same 404 for
// victim's sandbox as for one that never existed.
func noneOfIt(t *testing.T, d *cageserve.Daemon, who, key, victim string) {
	t.Helper()
	bodies := map[string]any{"timeout": map[string]any{"timeout": 1}, "refreshes": map[string]any{"duration": 1},
		"connect": map[string]any{"timeout": 1}, "network": map[string]any{"allowInternetAccess": true},
		"pause": map[string]any{}, "resume": map[string]any{"timeout": 1}, "snapshots": map[string]any{},
		"fork": map[string]any{"count": 2, "timeout": 60}}
	const ghost = "0123456789abcdef0123"
	for _, route := range sandboxRoutes(t) {
		method, path, _ := strings.Cut(route, " ")
		var body any
		if method != http.MethodGet && method != http.MethodDelete {
			if body = bodies[path[strings.LastIndex(path, "/")+1:]]; body == nil {
				body = map[string]any{}
			}
		}
		status, got, err := d.Do(method, strings.ReplaceAll(path, "{sandboxID}", victim), key, body)
		if err != nil {
			t.Fatalf("%s: %v", route, err)
		}
		gStatus, want, _ := d.Do(method, strings.ReplaceAll(path, "{sandboxID}", ghost), key, body)
		if status != http.StatusNotFound || gStatus != http.StatusNotFound {
			t.Errorf("%s by %s on another team's sandbox: %d %s (never existed: %d); want 404", route, who, status, got, gStatus)
		} else if strings.ReplaceAll(string(got), victim, ghost) != string(want) {
			t.Errorf("%s: %s learns the sandbox exists: %s, against %s", route, who, got, want)
		}
	}
}

// mcpCall calls one tool through /mcp with key; the tool's text.
func mcpCall(t *testing.T, d *cageserve.Daemon, key, tool string, args map[string]any) (string, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	hc := &http.Client{Transport: roundTrip(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", "Bearer "+key)
		return http.DefaultTransport.RoundTrip(r)
	})}
	c := mcp.NewClient(&mcp.Implementation{Name: "cage-abuse", Version: "0"}, nil)
	s, err := c.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + d.API + "/mcp", HTTPClient: hc}, nil)
	if err != nil {
		t.Fatalf("mcp connect: %v", err)
	}
	defer s.Close()
	res, err := s.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		t.Fatalf("mcp %s: %v", tool, err)
	}
	var text strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			text.WriteString(tc.Text)
		}
	}
	return text.String(), res.IsError
}

type roundTrip func(*http.Request) (*http.Response, error)

func (f roundTrip) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestCrossTeamMatrix: teams are the tenancy boundary. Two keys of team
// alpha share its sandboxes, snapshots, volumes and audit entries; a key
// of team beta and a key without a team get, on every sandbox route of the
// OpenAPI document, on the volume and snapshot routes, through the proxy,
// /mcp and /audit, exactly what they get for objects that never existed.
// Every admin route refuses a key that is not an admin key (403), and an
// admin key is no tenant of alpha's.
func TestCrossTeamMatrix(t *testing.T) {
	d := cageserve.Start(t)
	newTeam(t, d, "alpha")
	newTeam(t, d, "beta")
	a1, a2, b, solo := d.NewKeyIn(t, "a1", "alpha"), d.NewKeyIn(t, "a2", "alpha"), d.NewKeyIn(t, "b", "beta"), d.Key
	admin := d.NewKeyIn(t, "ops", "admin")
	sbA := d.Create(t, a1, map[string]any{"timeout": 600})
	sbB := d.Create(t, b, map[string]any{"timeout": 600})

	// Team-mates share: a2 sees, lists and extends a1's sandbox.
	if sd := detail(t, d, a2, sbA.SandboxID); sd.SandboxID != sbA.SandboxID {
		t.Errorf("a2's GET of a1's sandbox: %+v", sd)
	}
	if status, out, _ := d.Do("GET", "/v2/sandboxes", a2, nil); status != 200 || !strings.Contains(string(out), sbA.SandboxID) || strings.Contains(string(out), sbB.SandboxID) {
		t.Errorf("a2's list: %d %s", status, out)
	}
	if status, out, _ := d.Do("POST", "/sandboxes/"+sbA.SandboxID+"/timeout", a2, map[string]any{"timeout": 900}); status != http.StatusNoContent {
		t.Errorf("a2 extends a1's sandbox: %d %s", status, out)
	}
	before := detail(t, d, a1, sbA.SandboxID)
	for who, key := range map[string]string{"beta's key": b, "a key without a team": solo, "an admin key": admin} {
		noneOfIt(t, d, who, key, sbA.SandboxID)
		if status, out, _ := d.Do("GET", "/v2/sandboxes", key, nil); status != 200 || strings.Contains(string(out), sbA.SandboxID) {
			t.Errorf("%s's list: %d %s", who, status, out)
		}
	}
	after := detail(t, d, a1, sbA.SandboxID)
	if !after.EndAt.Equal(before.EndAt) || after.State != "running" || jsonOf(after.Network) != jsonOf(before.Network) {
		t.Errorf("alpha's sandbox changed under the others' attempts: %+v -> %+v", before, after)
	}

	// Snapshots: a2 lists a1's; beta lists none, deletes none, starts none.
	status, out, _ := d.Do("POST", "/sandboxes/"+sbA.SandboxID+"/snapshots", a1, map[string]any{"name": "base-a"})
	var snap types.SnapshotInfo
	if status != http.StatusCreated || json.Unmarshal(out, &snap) != nil {
		t.Fatalf("snapshot: %d %s", status, out)
	}
	if status, out, _ := d.Do("GET", "/snapshots", a2, nil); status != 200 || !strings.Contains(string(out), snap.SnapshotID) {
		t.Errorf("a2's snapshots: %d %s", status, out)
	}
	if status, out, _ := d.Do("GET", "/snapshots", b, nil); status != 200 || strings.Contains(string(out), snap.SnapshotID) {
		t.Errorf("beta's snapshots: %d %s", status, out)
	}
	ghostSnap := "cage/no-such-snapshot:default"
	for _, ref := range []string{snap.SnapshotID, ghostSnap} {
		if status, out, _ := d.Do("DELETE", "/templates/"+ref, b, nil); status != http.StatusNotFound {
			t.Errorf("beta deletes %s: %d %s", ref, status, out)
		}
	}
	_, st1, msg1 := d.TryCreate(b, map[string]any{"templateID": snap.SnapshotID})
	_, st2, msg2 := d.TryCreate(b, map[string]any{"templateID": ghostSnap})
	if st1 != st2 || st1 != http.StatusNotFound || strings.ReplaceAll(msg1, snap.SnapshotID, ghostSnap) != msg2 {
		t.Errorf("beta starts from alpha's snapshot: %d %s; from none: %d %s", st1, msg1, st2, msg2)
	}
	if sb := d.Create(t, a2, map[string]any{"templateID": snap.SnapshotID, "timeout": 60}); sb.SandboxID == "" {
		t.Error("a2 could not start from a1's snapshot")
	}

	// Volumes: a2 opens a1's; beta gets 404, as for none.
	vol := newVolume(t, d, a1, "shared")
	if status, out, _ := d.Do("GET", "/volumes/"+vol.VolumeID, a2, nil); status != 200 {
		t.Errorf("a2's GET of a1's volume: %d %s", status, out)
	}
	for _, m := range []string{"GET", "DELETE"} {
		st, got, _ := d.Do(m, "/volumes/"+vol.VolumeID, b, nil)
		gst, want, _ := d.Do(m, "/volumes/0123456789abcdef0123", b, nil)
		if st != 404 || gst != 404 || strings.ReplaceAll(string(got), vol.VolumeID, "0123456789abcdef0123") != string(want) {
			t.Errorf("%s of alpha's volume by beta: %d %s (none: %d %s)", m, st, got, gst, want)
		}
	}

	// The audit trail: a2 reads what a1 did and what happened to alpha's
	// sandbox, team column filled; beta reads none of it.
	var page types.AuditPage
	status, out, _ = d.Do("GET", "/audit?sandboxID="+sbA.SandboxID+"&limit=1000", a2, nil)
	if status != 200 || json.Unmarshal(out, &page) != nil {
		t.Fatalf("a2's audit: %d %s", status, out)
	}
	kinds := map[string]int{}
	alphaID := ""
	for _, e := range page.Entries {
		kinds[e.Kind]++
		if alphaID == "" {
			alphaID = e.TeamID
		}
		if !strings.HasPrefix(e.TeamID, "team_") || e.TeamID != alphaID {
			t.Errorf("an entry of alpha's sandbox without alpha's team: %+v", e)
		}
	}
	if kinds["sandbox.create"] != 1 || kinds["api.call"] < 3 || kinds["sandbox.snapshot"] != 1 {
		t.Errorf("a2's audit of alpha's sandbox: %v", kinds)
	}
	// The others read only their own refused calls naming it (a call is
	// its caller's entry), never alpha's.
	for _, key := range []string{b, solo} {
		status, out, _ = d.Do("GET", "/audit?sandboxID="+sbA.SandboxID+"&limit=1000", key, nil)
		if status != 200 || json.Unmarshal(out, &page) != nil {
			t.Fatalf("another team's audit: %d %s", status, out)
		}
		for _, e := range page.Entries {
			if e.Kind != "api.call" || e.Status != http.StatusNotFound || e.TeamID == alphaID {
				t.Errorf("another team reads alpha's entry: %+v", e)
			}
		}
	}

	// The proxy: beta's own sandbox's token opens nothing of alpha's.
	for _, path := range []string{"/envs", "/files?path=/etc/hostname"} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+d.Proxy+path, nil)
		req.Header.Set("E2b-Sandbox-Id", sbA.SandboxID)
		req.Header.Set("X-Access-Token", sbB.EnvdAccessToken)
		req.Header.Set("X-API-Key", b)
		resp, err := d.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s of alpha's sandbox with beta's token: %d, want 401", path, resp.StatusCode)
		}
	}

	// MCP: beta's tools meet the API's 404, as for a sandbox that never
	// existed; a2's reach alpha's sandbox.
	got, isErr := mcpCall(t, d, b, "exec", map[string]any{"sandbox_id": sbA.SandboxID, "command": "hostname"})
	want, _ := mcpCall(t, d, b, "exec", map[string]any{"sandbox_id": "0123456789abcdef0123", "command": "hostname"})
	if !isErr || strings.ReplaceAll(got, sbA.SandboxID, "0123456789abcdef0123") != want {
		t.Errorf("beta's exec on alpha's sandbox through /mcp: %q (error %v); for none: %q", got, isErr, want)
	}
	if got, isErr := mcpCall(t, d, a2, "exec", map[string]any{"sandbox_id": sbA.SandboxID, "command": "echo same-team"}); isErr || !strings.Contains(got, "same-team") {
		t.Errorf("a2's exec on a1's sandbox through /mcp: %q (error %v)", got, isErr)
	}
	adminRoutes(t, d, []string{a1, b, solo}, admin)
}

// adminRoutes: every /admin route of the document refuses each of keys
// (403) before reading its body, and answers the admin key.
func adminRoutes(t *testing.T, d *cageserve.Daemon, keys []string, admin string) {
	t.Helper()
	doc, err := apispec.Doc()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for path, item := range doc.Paths.Map() {
		if !strings.HasPrefix(path, "/admin/") {
			continue
		}
		real := strings.NewReplacer("{teamID}", "alpha", "{keyID}", "key_000000000000").Replace(path)
		for method := range item.Operations() {
			n++
			for _, k := range keys {
				if status, out, _ := d.Do(method, real, k, map[string]any{"name": "evil"}); status != http.StatusForbidden {
					t.Errorf("%s %s with a tenant's key: %d %s, want 403", method, path, status, out)
				}
			}
		}
	}
	if n < 8 {
		t.Errorf("the document lists %d admin routes", n)
	}
	var teams []types.Team
	status, out, _ := d.Do("GET", "/admin/teams", admin, nil)
	if status != 200 || json.Unmarshal(out, &teams) != nil || len(teams) != 2 {
		t.Errorf("GET /admin/teams as admin: %d %s", status, out)
	}
}
