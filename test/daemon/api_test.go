package daemontest

import (
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/sandbox"
)

// TestAPIRoutes drives every route of the control API end to end, each
// request and response checked against the OpenAPI document.
func TestAPIRoutes(t *testing.T) {
	t.Parallel()
	// The default pool: sandboxes come prepared, and get their limits,
	// storage size and environment when asked for.
	d := startDaemon(t, "--domain", "test.local", "--pool", "2")
	key := d.key
	// A running daemon's host has the kernel's host-wide limits (pids,
	// threads, open files, ptys) above what its sandboxes hold together.
	if low := sandbox.LowHostLimits(); len(low) > 0 {
		t.Errorf("host limits a tenant could use up for all, with a daemon running: %v", low)
	}
	suite := "routes-" + strings.ReplaceAll(time.Now().Format("150405.000000"), ".", "")

	// POST /v2/sandboxes with cage's limits, metadata and envVars.
	body := map[string]any{
		"templateID": "host", "timeout": 600,
		"cpuCount": 0.5, "memoryMB": 256, "diskSizeMB": 64, "pids": 100,
		"metadata": map[string]string{"suite": suite, "role": "main", "odd key": "a=b&c"},
		"envVars":  map[string]string{"FOO": "foo-from-envVars"},
	}
	sb := d.create(t, key, body)
	if sb.SandboxID == "" || sb.TemplateID != "host" || sb.EnvdAccessToken == "" || sb.Wall != "process" {
		t.Errorf("created sandbox %+v: want an id, templateID host, an access token and wall process", sb)
	}
	if sb.CPUCount != 0.5 || sb.MemoryMB != 256 || sb.DiskSizeMB != 64 || sb.Pids != 100 {
		t.Errorf("created sandbox echoes cpuCount %g memoryMB %d diskSizeMB %d pids %d; want 0.5 256 64 100",
			sb.CPUCount, sb.MemoryMB, sb.DiskSizeMB, sb.Pids)
	}
	if sb.Domain == nil || *sb.Domain != "test.local" {
		t.Errorf("created sandbox domain %v, want test.local (--domain)", sb.Domain)
	}

	// POST /sandboxes (v1).
	r := d.expect(t, http.StatusCreated, call{method: "POST", path: "/sandboxes", key: key, body: map[string]any{
		"templateID": "host", "timeout": 600, "secure": true,
		"metadata": map[string]string{"suite": suite, "role": "v1"},
	}})
	var v1 types.Sandbox
	r.decode(t, &v1)
	d.remember(v1.SandboxID, key)
	if v1.SandboxID == "" || v1.SandboxID == sb.SandboxID {
		t.Errorf("POST /sandboxes: sandbox id %q", v1.SandboxID)
	}

	// GET /sandboxes/{id}.
	got := d.get(t, key, sb.SandboxID)
	if got.SandboxID != sb.SandboxID || got.State != "running" || got.TemplateID != "host" ||
		got.EnvdAccessToken != sb.EnvdAccessToken || got.Metadata["suite"] != suite || got.Metadata["odd key"] != "a=b&c" ||
		got.CPUCount != 0.5 || got.MemoryMB != 256 || got.DiskSizeMB != 64 || got.Pids != 100 || got.Wall != "process" {
		t.Errorf("GET /sandboxes/%s = %+v; does not match what was created", sb.SandboxID, got)
	}
	if d := time.Until(got.EndAt); d < 590*time.Second || d > 601*time.Second {
		t.Errorf("endAt %v is %v from now, want about 600 s (timeout 600)", got.EndAt, d)
	}

	// envVars reach commands, through the proxy.
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	if out := mustRun(t, ac, "echo $FOO"); out != "foo-from-envVars\n" {
		t.Errorf("echo $FOO through the proxy: %q, want the envVars value", out)
	}

	// More sandboxes to filter and page through.
	var extra []string
	for i := 0; i < 3; i++ {
		role := "extra"
		if i == 0 {
			role = "main"
		}
		e := d.create(t, key, map[string]any{"timeout": 600, "metadata": map[string]string{"suite": suite, "role": role}})
		extra = append(extra, e.SandboxID)
	}
	other := d.create(t, key, map[string]any{"timeout": 600, "metadata": map[string]string{"suite": "not-" + suite, "role": "main"}})
	all := append([]string{sb.SandboxID, v1.SandboxID, other.SandboxID}, extra...)

	// Metadata filter: a URL-encoded query of its own.
	md := url.Values{"suite": {suite}, "role": {"main"}}.Encode()
	ids := idsOf(d.list(t, key, url.Values{"metadata": {md}}))
	if want := []string{sb.SandboxID, extra[0]}; !sameSet(ids, want) {
		t.Errorf("GET /v2/sandboxes?metadata=%s: %v, want %v", url.QueryEscape(md), ids, want)
	}
	ids = idsOf(d.list(t, key, url.Values{"metadata": {url.Values{"odd key": {"a=b&c"}}.Encode()}}))
	if want := []string{sb.SandboxID}; !sameSet(ids, want) {
		t.Errorf("metadata filter with '=' and '&' in the value: %v, want %v", ids, want)
	}
	// State filter.
	if ids := idsOf(d.list(t, key, url.Values{"state": {"running"}})); !sameSet(ids, all) {
		t.Errorf("GET /v2/sandboxes?state=running: %v, want %v", ids, all)
	}
	if ids := idsOf(d.list(t, key, url.Values{"state": {"paused"}})); len(ids) != 0 {
		t.Errorf("GET /v2/sandboxes?state=paused: %v, want none", ids)
	}
	if ids := idsOf(d.list(t, key, url.Values{"state": {"running,paused"}})); !sameSet(ids, all) {
		t.Errorf("GET /v2/sandboxes?state=running,paused: %v, want %v", ids, all)
	}
	// limit=1: one per page, each exactly once, the last page without a token.
	q := url.Values{"limit": {"1"}}
	seen := map[string]int{}
	pages := 0
	for {
		r := d.expect(t, http.StatusOK, call{method: "GET", path: "/v2/sandboxes?" + q.Encode(), key: key})
		var page []types.ListedSandbox
		r.decode(t, &page)
		pages++
		if len(page) > 1 {
			t.Errorf("limit=1 page holds %d sandboxes", len(page))
		}
		for _, l := range page {
			seen[l.SandboxID]++
		}
		next := r.header.Get("X-Next-Token")
		if next == "" {
			break
		}
		if pages > 20 {
			t.Fatalf("limit=1: still paging after %d pages", pages)
		}
		q.Set("nextToken", next)
	}
	for _, id := range all {
		if seen[id] != 1 {
			t.Errorf("paging with limit=1: sandbox %s seen %d times, want once (seen %v)", id, seen[id], seen)
		}
	}
	if len(seen) != len(all) || pages < len(all) || pages > len(all)+1 {
		t.Errorf("paging with limit=1: %d pages, %d sandboxes, want %d sandboxes", pages, len(seen), len(all))
	}

	// GET /sandboxes (v1): every running sandbox, unpaginated.
	r = d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes", key: key})
	var v1list []types.ListedSandbox
	r.decode(t, &v1list)
	if ids := idsOf(v1list); !sameSet(ids, all) {
		t.Errorf("GET /sandboxes: %v, want %v", ids, all)
	}
	r = d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes?metadata=" + url.QueryEscape(md), key: key})
	r.decode(t, &v1list)
	if ids, want := idsOf(v1list), []string{sb.SandboxID, extra[0]}; !sameSet(ids, want) {
		t.Errorf("GET /sandboxes?metadata=%s: %v, want %v", md, ids, want)
	}

	// POST /sandboxes/{id}/timeout sets the deadline, shorter or longer.
	path := "/sandboxes/" + sb.SandboxID
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/timeout", key: key, body: map[string]any{"timeout": 100}})
	if end := d.get(t, key, sb.SandboxID).EndAt; !about(end, 100*time.Second) {
		t.Errorf("after timeout 100, endAt is %v from now", time.Until(end))
	}
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/timeout", key: key, body: map[string]any{"timeout": 900}})
	if end := d.get(t, key, sb.SandboxID).EndAt; !about(end, 900*time.Second) {
		t.Errorf("after timeout 900, endAt is %v from now", time.Until(end))
	}

	// POST /sandboxes/{id}/refreshes: at least duration from now; the
	// document says it never shortens the deadline.
	before := d.get(t, key, sb.SandboxID).EndAt
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/refreshes", key: key, body: map[string]any{"duration": 30}})
	if end := d.get(t, key, sb.SandboxID).EndAt; end.Before(before) {
		t.Errorf("POST /refreshes {duration: 30} moved endAt earlier, from %v to %v from now (the document: \"unlike /timeout it never shortens it\")",
			time.Until(before).Round(time.Second), time.Until(end).Round(time.Second))
		// Put the deadline back for what follows.
		d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/timeout", key: key, body: map[string]any{"timeout": 900}})
	}
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/refreshes", key: key, body: map[string]any{"duration": 1200}})
	if end := d.get(t, key, sb.SandboxID).EndAt; !about(end, 1200*time.Second) {
		t.Errorf("after refresh 1200, endAt is %v from now", time.Until(end))
	}
	before = d.get(t, key, sb.SandboxID).EndAt
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/refreshes", key: key})
	if end := d.get(t, key, sb.SandboxID).EndAt; end.Before(before) {
		t.Errorf("POST /refreshes without a body moved endAt earlier, from %v to %v from now",
			time.Until(before).Round(time.Second), time.Until(end).Round(time.Second))
		d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/timeout", key: key, body: map[string]any{"timeout": 1200}})
	}

	// POST /sandboxes/{id}/connect and /v2/.../connect: 200, and the
	// deadline only ever moves later.
	for _, c := range []struct {
		path string
		body any
		want time.Duration // the deadline is at least this far off after
	}{
		{path + "/connect", map[string]any{"timeout": 10}, 0},
		{"/v2" + path + "/connect", map[string]any{"timeout": 10}, 0},
		{"/v2" + path + "/connect", nil, 0},
		{"/v2" + path + "/connect", map[string]any{"timeout": 1800}, 1790 * time.Second},
		{path + "/connect", map[string]any{"timeout": 2400}, 2390 * time.Second},
	} {
		before := d.get(t, key, sb.SandboxID).EndAt
		r := d.expect(t, http.StatusOK, call{method: "POST", path: c.path, key: key, body: c.body})
		var cs types.Sandbox
		r.decode(t, &cs)
		if cs.SandboxID != sb.SandboxID || cs.EnvdAccessToken != sb.EnvdAccessToken {
			t.Errorf("POST %s: %+v, want the sandbox and its access token", c.path, cs)
		}
		end := d.get(t, key, sb.SandboxID).EndAt
		if end.Before(before) {
			t.Errorf("POST %s %v moved endAt earlier: from %v to %v", c.path, c.body, before, end)
		}
		if time.Until(end) < c.want {
			t.Errorf("POST %s %v: endAt only %v from now, want at least %v", c.path, c.body, time.Until(end), c.want)
		}
	}

	// GET /sandboxes/{id}/metrics.
	m := d.metrics(t, key, sb.SandboxID)
	if m.MemUsed <= 0 || m.MemTotal != 256<<20 || m.DiskTotal != 64<<20 || m.CPUCount != 0.5 {
		t.Errorf("metrics %+v: want memUsed > 0, memTotal %d (256 MiB), diskTotal %d (64 MiB), cpuCount 0.5", m, 256<<20, 64<<20)
	}
	burn := time.Now()
	mustRun(t, ac, `end=$(($(date +%s)+2)); while [ "$(date +%s)" -lt "$end" ]; do :; done`)
	if m := d.metricsAfter(t, key, sb.SandboxID, burn.Add(time.Second)); !(m.CPUUsedPct > 0) {
		t.Errorf("metrics after burning CPU for a second or two: cpuUsedPct %v, want > 0 (%+v)", m.CPUUsedPct, m)
	}
	d.expect(t, http.StatusOK, call{method: "GET", path: path + "/metrics?start=0&end=" + strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10), key: key})

	// DELETE, then it is gone.
	d.kill(t, key, sb.SandboxID)
	d.expect(t, http.StatusNotFound, call{method: "GET", path: path, key: key})
	d.expect(t, http.StatusNotFound, call{method: "DELETE", path: path, key: key})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: path + "/metrics", key: key})
	d.checkGone(t, sb.SandboxID, 5*time.Second)
	if ids := idsOf(d.list(t, key, nil)); slices.Contains(ids, sb.SandboxID) {
		t.Errorf("killed sandbox %s still listed: %v", sb.SandboxID, ids)
	}
	for _, id := range append([]string{v1.SandboxID, other.SandboxID}, extra...) {
		d.kill(t, key, id)
	}
	if ids := idsOf(d.list(t, key, nil)); len(ids) != 0 {
		t.Errorf("after killing every sandbox, still listed: %v", ids)
	}
	for _, id := range all {
		d.checkGone(t, id, 5*time.Second)
	}
}

// metrics returns the newest sample of GET /sandboxes/{id}/metrics, once
// there is one: none exists in a sandbox's first 5 s, as on E2B.
func (d *daemon) metrics(t *testing.T, key, id string) types.SandboxMetric {
	t.Helper()
	return d.metricsAfter(t, key, id, time.Time{})
}

// metricsAfter returns the newest sample, once one taken after since
// exists (samples are taken every 5 s).
func (d *daemon) metricsAfter(t *testing.T, key, id string, since time.Time) types.SandboxMetric {
	t.Helper()
	var ms []types.SandboxMetric
	fresh := func() bool { return len(ms) > 0 && ms[len(ms)-1].Timestamp.After(since) }
	for deadline := time.Now().Add(12 * time.Second); !fresh(); time.Sleep(250 * time.Millisecond) {
		r := d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + id + "/metrics", key: key})
		r.decode(t, &ms)
		if !fresh() && time.Now().After(deadline) {
			t.Fatalf("GET /sandboxes/%s/metrics: no sample after %v, 12 s on (%d samples)", id, since.Format(time.RFC3339), len(ms))
		}
	}
	m := ms[len(ms)-1]
	if d := time.Since(m.Timestamp); d < -5*time.Second || d > time.Minute || m.TimestampUnix != m.Timestamp.Unix() {
		t.Errorf("metrics sample timestamp %v (unix %d): want now", m.Timestamp, m.TimestampUnix)
	}
	return m
}

func idsOf(ls []types.ListedSandbox) []string {
	var ids []string
	for _, l := range ls {
		ids = append(ids, l.SandboxID)
	}
	return ids
}

// sameSet reports whether a and b hold the same ids, each once.
func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// about reports whether end is d from now, give or take 10 s.
func about(end time.Time, d time.Duration) bool {
	left := time.Until(end)
	return left > d-10*time.Second && left <= d+time.Second
}
