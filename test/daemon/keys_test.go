package daemontest

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// TestAPIKeys checks that a key sees only its own sandboxes (another key
// gets 404, never 403, as if they did not exist), and that missing,
// malformed, unknown and revoked keys get 401.
func TestAPIKeys(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	keyA := d.key
	// Made while the daemon runs: it must take it without a restart.
	keyB := d.createKey(t, "second")
	if keyA == keyB {
		t.Fatalf("two keys are the same: %s", keyA)
	}

	sbA := d.create(t, keyA, map[string]any{"metadata": map[string]string{"owner": "a"}})
	sbB := d.create(t, keyB, map[string]any{"metadata": map[string]string{"owner": "b"}})
	path := "/sandboxes/" + sbA.SandboxID

	// B cannot reach A's sandbox by any route, and learns nothing of it.
	for _, c := range []call{
		{method: "GET", path: path},
		{method: "DELETE", path: path},
		{method: "POST", path: path + "/timeout", body: map[string]any{"timeout": 5}},
		{method: "POST", path: path + "/refreshes", body: map[string]any{"duration": 5}},
		{method: "POST", path: path + "/connect", body: map[string]any{"timeout": 5}},
		{method: "POST", path: "/v2" + path + "/connect", body: map[string]any{"timeout": 5}},
		{method: "GET", path: path + "/metrics"},
	} {
		c.key = keyB
		r := d.expect(t, http.StatusNotFound, c)
		// The answer is the one for a sandbox that never existed.
		c.path = strings.Replace(c.path, sbA.SandboxID, "0123456789abcdef0123", 1)
		n := d.expect(t, http.StatusNotFound, c)
		if strings.ReplaceAll(string(r.body), sbA.SandboxID, "0123456789abcdef0123") != string(n.body) {
			t.Errorf("%s %s with another key: %s; for a sandbox that does not exist: %s (must be indistinguishable)",
				c.method, c.path, r.body, n.body)
		}
	}
	// A's sandbox is untouched: still there, deadline not moved to 5 s.
	if got := d.get(t, keyA, sbA.SandboxID); time.Until(got.EndAt) < time.Minute {
		t.Errorf("another key's timeout/refresh/connect moved A's deadline to %v from now", time.Until(got.EndAt))
	}
	for _, q := range []string{"/v2/sandboxes", "/sandboxes"} {
		var ls []types.ListedSandbox
		d.expect(t, http.StatusOK, call{method: "GET", path: q, key: keyB}).decode(t, &ls)
		if ids := idsOf(ls); !slices.Equal(ids, []string{sbB.SandboxID}) {
			t.Errorf("GET %s with key B: %v, want only B's %s", q, ids, sbB.SandboxID)
		}
		d.expect(t, http.StatusOK, call{method: "GET", path: q, key: keyA}).decode(t, &ls)
		if ids := idsOf(ls); !slices.Equal(ids, []string{sbA.SandboxID}) {
			t.Errorf("GET %s with key A: %v, want only A's %s", q, ids, sbA.SandboxID)
		}
	}
	// A's sandbox still runs commands.
	ac := d.agent(sbA.SandboxID, sbA.EnvdAccessToken)
	defer ac.Close()
	if out := mustRun(t, ac, "echo alive"); out != "alive\n" {
		t.Errorf("A's sandbox after B's attempts: %q", out)
	}

	// Missing, malformed and unknown keys: 401 on every route.
	unknown := "e2b_" + strings.Repeat("0", 40)
	for _, key := range []string{"", "garbage", "e2b_", "e2b_" + strings.Repeat("G", 40), strings.ToUpper(keyA), keyA + "0", unknown} {
		for _, c := range []call{
			{method: "GET", path: "/v2/sandboxes"},
			{method: "GET", path: "/sandboxes"},
			{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host"}},
			{method: "POST", path: "/sandboxes", body: map[string]any{"templateID": "host"}},
			{method: "GET", path: path},
			{method: "DELETE", path: path},
			{method: "POST", path: path + "/timeout", body: map[string]any{"timeout": 5}},
			{method: "GET", path: path + "/metrics"},
		} {
			c.key = key
			d.expect(t, http.StatusUnauthorized, c)
		}
	}

	// Revocation takes effect on the next request.
	keys := d.listKeys(t)
	if len(keys) != 2 {
		t.Fatalf("cage keys ls --json: %d keys, want 2: %+v", len(keys), keys)
	}
	var idB string
	for _, k := range keys {
		if k.RevokedAt != nil {
			t.Errorf("key %s is revoked before anyone revoked it", k.ID)
		}
		if strings.HasPrefix(keyB, "e2b_"+k.Prefix) && k.Name == "second" {
			idB = k.ID
		}
	}
	if idB == "" {
		t.Fatalf("cage keys ls --json: no key named second with B's prefix: %+v", keys)
	}
	// B's sandbox goes first: nothing could kill it through the API once
	// its key is revoked.
	d.kill(t, keyB, sbB.SandboxID)
	cmd := d.cageCmd(context.Background(), nil, "keys", "revoke", "--data", d.data, idB)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if out, err := cmd.Output(); err != nil || !strings.Contains(string(out), idB) {
		t.Fatalf("cage keys revoke %s: %v, stdout %q, stderr %q", idB, err, out, stderr.String())
	}
	noStack(t, "cage keys revoke", stderr.String())
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/v2/sandboxes", key: keyB})
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/sandboxes/" + sbB.SandboxID, key: keyB})
	d.expect(t, http.StatusUnauthorized, call{method: "DELETE", path: "/sandboxes/" + sbB.SandboxID, key: keyB})
	d.expect(t, http.StatusUnauthorized, call{method: "POST", path: "/v2/sandboxes", key: keyB, body: map[string]any{"templateID": "host"}})
	// A is unaffected.
	d.expect(t, http.StatusOK, call{method: "GET", path: path, key: keyA})

	keys = d.listKeys(t)
	if len(keys) != 2 {
		t.Fatalf("cage keys ls --json after revoking: %d keys, want both: %+v", len(keys), keys)
	}
	for _, k := range keys {
		switch revoked := k.RevokedAt != nil; {
		case k.ID == idB && !revoked:
			t.Errorf("cage keys ls --json: the revoked key %s is not marked revoked: %+v", k.ID, k)
		case k.ID != idB && revoked:
			t.Errorf("cage keys ls --json: key %s is marked revoked, only %s was: %+v", k.ID, idB, k)
		}
	}
	// The plain listing marks it too.
	cmd = d.cageCmd(context.Background(), nil, "keys", "ls", "--data", d.data)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cage keys ls: %v", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, idB) && !strings.Contains(line, "revoked") {
			t.Errorf("cage keys ls: the line of %s does not say revoked: %q", idB, line)
		}
		if strings.Contains(line, keyA) || strings.Contains(line, keyB) {
			t.Errorf("cage keys ls shows a whole key: %q", line)
		}
	}
	d.kill(t, keyA, sbA.SandboxID)
	d.expect(t, http.StatusNotFound, call{method: "GET", path: path, key: keyA})
}

// apiKey is one entry of `cage keys ls --json`.
type apiKey struct {
	ID        string
	Name      string
	Prefix    string
	CreatedAt time.Time
	RevokedAt *time.Time
}

func (d *daemon) listKeys(t *testing.T) []apiKey {
	t.Helper()
	cmd := d.cageCmd(context.Background(), nil, "keys", "ls", "--json", "--data", d.data)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cage keys ls --json: %v: %s", err, stderr.Bytes())
	}
	var keys []apiKey
	if err := json.Unmarshal(out, &keys); err != nil {
		t.Fatalf("cage keys ls --json: %v: %s", err, out)
	}
	for _, k := range keys {
		if k.ID == "" || k.Prefix == "" || k.CreatedAt.IsZero() {
			t.Errorf("cage keys ls --json: entry without id, prefix or creation time: %s", out)
		}
	}
	if strings.Contains(string(out), "e2b_") && bytes.Contains(out, []byte(`"key"`)) {
		t.Errorf("cage keys ls --json shows keys: %s", out)
	}
	return keys
}
