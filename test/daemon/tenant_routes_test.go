package daemontest

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// TestTenantRoutes: another key reaches none of a key's sandbox's
// lifecycle routes (pause, resume, snapshots, fork, network, its network
// records) nor its snapshots (delete, create from, list), and each answer
// is the one for a sandbox or snapshot that never existed.
func TestTenantRoutes(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	keyA, keyB := d.key, d.createKey(t, "b")
	sbA := d.create(t, keyA, nil)
	path := "/sandboxes/" + sbA.SandboxID
	const none = "0123456789abcdef0123"

	var sn types.SnapshotInfo
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/snapshots", key: keyA,
		body: map[string]any{"name": "mine"}}).decode(t, &sn)

	same := func(c call, real, fake string, want int) {
		t.Helper()
		c.key = keyB
		r := d.expect(t, want, c)
		c.path = strings.ReplaceAll(c.path, real, fake)
		if b, ok := c.body.(map[string]any); ok {
			nb := map[string]any{}
			for k, v := range b {
				if s, ok := v.(string); ok {
					v = strings.ReplaceAll(s, real, fake)
				}
				nb[k] = v
			}
			c.body = nb
		}
		n := d.expect(t, want, c)
		if strings.ReplaceAll(string(r.body), real, fake) != string(n.body) {
			t.Errorf("%s %s with another key: %s; for one that does not exist: %s (must be indistinguishable)",
				c.method, c.path, r.body, n.body)
		}
	}
	for _, c := range []call{
		{method: "POST", path: path + "/pause"},
		{method: "POST", path: path + "/resume"},
		{method: "POST", path: path + "/snapshots", body: map[string]any{"name": "theirs"}},
		{method: "POST", path: path + "/fork", body: map[string]any{"count": 1}},
		{method: "PUT", path: path + "/network", body: map[string]any{"allowOut": []string{"0.0.0.0/0"}}},
		{method: "GET", path: path + "/network/records"},
	} {
		same(c, sbA.SandboxID, none, http.StatusNotFound)
	}
	// A's snapshot: not B's to delete or start from, by ref or by name
	// (a named snapshot's ref is cage/NAME:default).
	for _, ref := range []string{sn.SnapshotID, "cage/mine", "mine"} {
		same(call{method: "DELETE", path: "/templates/" + url.PathEscape(ref)}, "mine", "nosuchname", http.StatusNotFound)
		same(call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": ref}}, "mine", "nosuchname", http.StatusNotFound)
	}
	// Unnamed: by its id.
	var un types.SnapshotInfo
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/snapshots", key: keyA}).decode(t, &un)
	id := strings.TrimSuffix(un.SnapshotID, ":default")
	for _, ref := range []string{un.SnapshotID, id} {
		same(call{method: "DELETE", path: "/templates/" + url.PathEscape(ref)}, id, "snap"+none, http.StatusNotFound)
		same(call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": ref}}, id, "snap"+none, http.StatusNotFound)
	}
	var ls []types.SnapshotInfo
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots?sandboxID=" + sbA.SandboxID, key: keyB}).decode(t, &ls)
	if len(ls) != 0 {
		t.Errorf("GET /snapshots?sandboxID=A's with key B: %+v, want none", ls)
	}
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots", key: keyB}).decode(t, &ls)
	if len(ls) != 0 {
		t.Errorf("GET /snapshots with key B: %+v, want none", ls)
	}
	var page types.AuditPage
	d.expect(t, http.StatusOK, call{method: "GET", path: "/audit?sandboxID=" + sbA.SandboxID, key: keyB}).decode(t, &page)
	for _, e := range page.Entries {
		if e.Kind != "api.call" || e.KeyID == "" {
			t.Errorf("GET /audit?sandboxID=A's with key B: an entry not B's own call: %+v", e)
		}
	}
	// A's sandbox and snapshot are as they were.
	if got := d.get(t, keyA, sbA.SandboxID); got.State != types.SandboxStateRunning || time.Until(got.EndAt) < time.Minute {
		t.Errorf("A's sandbox after B's attempts: %+v", got)
	}
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots", key: keyA}).decode(t, &ls)
	if len(ls) != 2 {
		t.Errorf("A's snapshots after B's attempts: %+v, want its two", ls)
	}
}
