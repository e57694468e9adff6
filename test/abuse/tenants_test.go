package abuse

import (
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/apispec"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestCrossKeyMatrix: every route of the API that names a sandbox, as the
// OpenAPI document lists them (so a route added later is covered), tried
// by tenant B on tenant A's sandbox. Each must answer 404 exactly as for a
// sandbox that never existed, and change nothing of A's: its life, its
// network policy, its records. B cannot reach it through the proxy with its
// own sandbox's token either.
func TestCrossKeyMatrix(t *testing.T) {
	d := cageserve.Start(t)
	keyA, keyB := d.Key, d.NewKey(t, "tenant-b")
	sbA := d.Create(t, keyA, map[string]any{"timeout": 600, "metadata": map[string]string{"owner": "a"},
		"network": map[string]any{"allowOut": []string{"example.com"}, "denyOut": []string{"0.0.0.0/0"}}})
	sbB := d.Create(t, keyB, map[string]any{"timeout": 600})
	before := detail(t, d, keyA, sbA.SandboxID)

	doc, err := apispec.Doc()
	if err != nil {
		t.Fatal(err)
	}
	// Bodies that would change A's sandbox were B allowed: short timeouts,
	// an open network.
	bodies := map[string]any{"timeout": map[string]any{"timeout": 1}, "refreshes": map[string]any{"duration": 1},
		"connect": map[string]any{"timeout": 1}, "network": map[string]any{"allowInternetAccess": true},
		"pause": map[string]any{}, "resume": map[string]any{"timeout": 1}, "snapshots": map[string]any{},
		"fork": map[string]any{"count": 2, "timeout": 60}}
	const ghost = "0123456789abcdef0123"
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
	for _, route := range routes {
		method, path, _ := strings.Cut(route, " ")
		last := path[strings.LastIndex(path, "/")+1:]
		var body any
		if method != http.MethodGet && method != http.MethodDelete {
			body = bodies[last]
			if body == nil {
				body = map[string]any{}
			}
		}
		real := strings.ReplaceAll(path, "{sandboxID}", sbA.SandboxID)
		status, got, err := d.Do(method, real, keyB, body)
		if err != nil {
			t.Fatalf("%s: %v", route, err)
		}
		gStatus, want, _ := d.Do(method, strings.ReplaceAll(path, "{sandboxID}", ghost), keyB, body)
		if status != http.StatusNotFound || gStatus != http.StatusNotFound {
			t.Errorf("%s with tenant B's key on A's sandbox: %d %s (for a sandbox that never existed: %d); want 404", route, status, got, gStatus)
			continue
		}
		if strings.ReplaceAll(string(got), sbA.SandboxID, ghost) != string(want) {
			t.Errorf("%s: B learns A's sandbox exists: %s, against %s for one that does not", route, got, want)
		}
	}
	after := detail(t, d, keyA, sbA.SandboxID)
	if after.EndAt.Before(before.EndAt) || !after.EndAt.After(time.Now().Add(5*time.Minute)) {
		t.Errorf("A's end moved from %v to %v after B's attempts", before.EndAt, after.EndAt)
	}
	if nb, na := jsonOf(before.Network), jsonOf(after.Network); na != nb || after.State != "running" {
		t.Errorf("A's sandbox changed after B's attempts: network %s -> %s, state %s", nb, na, after.State)
	}
	// Listing shows B only its own.
	status, out, _ := d.Do(http.MethodGet, "/v2/sandboxes", keyB, nil)
	if status != http.StatusOK || strings.Contains(string(out), sbA.SandboxID) || !strings.Contains(string(out), sbB.SandboxID) {
		t.Errorf("GET /v2/sandboxes with B's key: %d %s; want B's sandbox alone", status, out)
	}
	// The proxy: B's own sandbox's token opens nothing of A's.
	for _, path := range []string{"/envs", "/files?path=/etc/hostname"} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+d.Proxy+path, nil)
		req.Header.Set("E2b-Sandbox-Id", sbA.SandboxID)
		req.Header.Set("X-Access-Token", sbB.EnvdAccessToken)
		resp, err := d.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s of A's sandbox with B's sandbox token: %d, want 401", path, resp.StatusCode)
		}
	}
}

// jsonOf is v as JSON, to compare and show.
func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func detail(t *testing.T, d *cageserve.Daemon, key, id string) types.SandboxDetail {
	t.Helper()
	status, out, err := d.Do(http.MethodGet, "/sandboxes/"+id, key, nil)
	var sd types.SandboxDetail
	if err != nil || status != http.StatusOK || json.Unmarshal(out, &sd) != nil {
		t.Fatalf("GET /sandboxes/%s: %d %s %v", id, status, out, err)
	}
	return sd
}

// TestConcurrentCreates: 200 creates at once against --max-sandboxes 8.
// Exactly 8 sandboxes exist at the end, every other create got 429 with
// Retry-After (never a 5xx or a hang), and once they are killed nothing is
// left on the host.
func TestConcurrentCreates(t *testing.T) {
	const max = 8
	d := cageserve.Start(t, "--max-sandboxes", "8")
	n := scale(200)
	statuses := make([]int, n)
	ids := make([]string, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			sb, status, msg := d.TryCreate(d.Key, map[string]any{"timeout": 300})
			statuses[i], ids[i] = status, sb.SandboxID
			if status != http.StatusCreated && status != http.StatusTooManyRequests {
				t.Errorf("create %d: %d %s", i, status, msg)
			}
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	count := map[int]int{}
	for _, s := range statuses {
		count[s]++
	}
	t.Logf("%d concurrent creates in %v: %v", n, time.Since(t0).Round(time.Millisecond), count)
	if count[http.StatusCreated] != max {
		t.Errorf("%d creates succeeded with --max-sandboxes %d", count[http.StatusCreated], max)
	}
	status, out, _ := d.Do(http.MethodGet, "/v2/sandboxes", d.Key, nil)
	var listed []types.ListedSandbox
	_ = json.Unmarshal(out, &listed)
	if status != http.StatusOK || len(listed) != max {
		t.Errorf("after the burst the list has %d sandboxes (%d), want %d", len(listed), status, max)
	}
	for _, id := range ids {
		if id != "" {
			d.Kill(d.Key, id)
		}
	}
	waitEmpty(t, d)
}

// waitEmpty waits until the daemon's run directory holds no sandbox.
func waitEmpty(t *testing.T, d *cageserve.Daemon) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left := sandboxDirs(d)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("sandboxes left on the host 30 s after they were killed: %v", left)
			return
		}
	}
}
