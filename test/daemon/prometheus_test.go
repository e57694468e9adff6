package daemontest

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
)

// scrape fetches /metrics with token and parses it with Prometheus's own
// text parser; it also returns the text.
func scrape(t *testing.T, addr, token string) (map[string]*dto.MetricFamily, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/metrics", nil)
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %s", resp.StatusCode, b)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(b)))
	if err != nil {
		t.Fatalf("Prometheus's parser refuses the scrape: %v", err)
	}
	return fams, string(b)
}

// sample is the value of family name's series whose labels include want
// (a histogram's sample count); -1 when there is none.
func sample(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return -1
}

// records counts a sandbox's network records by kind and decision.
func (d *daemon) recordCounts(t *testing.T, key, id string) map[[2]string]float64 {
	t.Helper()
	var page types.NetworkRecords
	d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + id + "/network/records?limit=1000", key: key}).decode(t, &page)
	out := map[[2]string]float64{}
	for _, r := range page.Records {
		out[[2]string{string(r.Kind), string(r.Decision)}]++
	}
	return out
}

// TestMetricsScrape: a scripted workload, then /metrics scraped and parsed
// with Prometheus's own parser: each counter is what the test did (API
// calls by route and status, creates and their latency, a create refused
// by a team's quota, envd RPCs through the proxy and their bytes, a kill
// and a timeout, an OOM kill as the audit trail counts it, network
// decisions as the records API lists them), the gauges are what exists
// (sandboxes by state, the team's quota use), the Go runtime's and the
// process's are there, and no tenant's id appears. /metrics is on its own
// listener only, behind its token, and absent from the API.
func TestMetricsScrape(t *testing.T) {
	maddr := freePort(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	const token = "metrics-token-0123456789abcdef"
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--metrics", maddr, "--metrics-token-file", tokenFile)
	if r := d.cli(t, "", "teams", "create", "alpha", "--sandboxes", "2", "--data", d.data); r.code != 0 {
		t.Fatalf("cage teams create: %v", r)
	}
	r := d.cli(t, "", "keys", "create", "--team", "alpha", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	alpha := lines[len(lines)-1]
	if r.code != 0 || !keyRE.MatchString(alpha) {
		t.Fatalf("cage keys create --team alpha: %v", r)
	}

	// The workload.
	net := map[string]any{"allowOut": []string{"allowed.example.com"}, "denyOut": []string{"0.0.0.0/0"}}
	sb1 := d.create(t, alpha, map[string]any{"network": net})
	// sb2 times out, but only once the create over the quota was refused:
	// created with a timeout of 1 s, it could end (its clock starts before
	// its create returns) before that create came on a slow host, and
	// the create went through.
	sb2 := d.create(t, alpha, map[string]any{"timeout": 600})
	refused := d.do(t, call{method: "POST", path: "/v2/sandboxes", key: alpha, body: map[string]any{"templateID": "host"}})
	if refused.status != http.StatusTooManyRequests || !strings.Contains(string(refused.body), "quota") {
		t.Fatalf("a create over alpha's quota: %v", refused)
	}
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb2.SandboxID + "/timeout", key: alpha,
		body: map[string]any{"timeout": 1}})
	small := d.create(t, d.key, map[string]any{"memoryMB": 64})
	ac, small1 := d.agent(sb1.SandboxID, sb1.EnvdAccessToken), d.agent(small.SandboxID, small.EnvdAccessToken)
	defer ac.Close()
	defer small1.Close()
	starts := 0
	runIn := func(c *agentclient.Client, script string) runResult {
		starts++
		return run(c, script)
	}
	for range 5 {
		if r := runIn(ac, "true"); r.err != nil || r.exit != 0 {
			t.Fatalf("true: %+v", r)
		}
	}
	runIn(ac, `python3 -c '
import socket
for n in ("allowed.example.com", "denied.example.net"):
    try: socket.getaddrinfo(n, 80, socket.AF_INET)
    except Exception: pass
s = socket.socket(); s.settimeout(2)
try: s.connect(("169.254.169.254", 80))
except Exception: pass'`)
	runIn(small1, `python3 -c 'b = bytearray(256 << 20)'`)
	for range 3 {
		d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + sb1.SandboxID, key: alpha})
	}
	for range 2 {
		d.expect(t, http.StatusNotFound, call{method: "GET", path: "/sandboxes/" + sb1.SandboxID, key: d.key})
	}
	// The host reads the cgroup's OOM counter with its samples (5 s).
	oom := d.waitAudit(t, d.key, "sandbox.oom", func(e types.AuditEntry) bool { return e.SandboxID == small.SandboxID })
	d.kill(t, d.key, small.SandboxID)
	d.checkGone(t, sb2.SandboxID, 30*time.Second) // its timeout

	// The scrape, until the asynchronous counts (network decisions, the
	// cgroup's OOM counter) agree with what the records and the trail say.
	var fams map[string]*dto.MetricFamily
	var text string
	var recs map[[2]string]float64
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		recs = d.recordCounts(t, alpha, sb1.SandboxID)
		fams, text = scrape(t, maddr, token)
		agree := recs[[2]string{"connect", "deny"}] > 0 && recs[[2]string{"dns", "allow"}] > 0
		for k, n := range recs {
			agree = agree && sample(fams, "cage_network_decisions_total", map[string]string{"kind": k[0], "decision": k[1]}) == n
		}
		if agree || time.Now().After(deadline) {
			break
		}
	}
	for k, n := range recs {
		if got := sample(fams, "cage_network_decisions_total", map[string]string{"kind": k[0], "decision": k[1]}); got != n {
			t.Errorf("network decisions %v: %v in the metrics, %v records", k, got, n)
		}
	}
	if recs[[2]string{"connect", "deny"}] == 0 || recs[[2]string{"dns", "allow"}] == 0 || recs[[2]string{"dns", "deny"}] == 0 {
		t.Errorf("the sandbox's records lack a decision the workload made: %v", recs)
	}
	oomKills, _ := oom.Detail["oom_kills"].(float64)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"cage_api_requests_total", map[string]string{"route": "POST /v2/sandboxes", "code": "201"}, 3},
		{"cage_api_requests_total", map[string]string{"route": "POST /v2/sandboxes", "code": "429"}, 1},
		{"cage_api_requests_total", map[string]string{"route": "GET /sandboxes/{sandboxID}", "code": "200"}, 3},
		{"cage_api_requests_total", map[string]string{"route": "GET /sandboxes/{sandboxID}", "code": "404"}, 2},
		{"cage_api_requests_total", map[string]string{"route": "DELETE /sandboxes/{sandboxID}", "code": "204"}, 1},
		{"cage_api_request_duration_seconds", map[string]string{"route": "POST /v2/sandboxes"}, 4},
		{"cage_quota_refused_total", map[string]string{"quota": "sandboxes"}, 1},
		{"cage_sandbox_creates_total", map[string]string{"wall": "process", "result": "ok"}, 3},
		{"cage_sandbox_create_duration_seconds", map[string]string{"wall": "process"}, 3},
		{"cage_sandbox_ends_total", map[string]string{"reason": "kill"}, 1},
		{"cage_sandbox_ends_total", map[string]string{"reason": "timeout"}, 1},
		{"cage_sandbox_limit_hits_total", map[string]string{"limit": "oom"}, oomKills},
		{"cage_proxy_requests_total", map[string]string{"port": "envd", "rpc": "/process.Process/Start", "code": "200"}, float64(starts)},
		{"cage_sandboxes", map[string]string{"state": "running", "wall": "process", "template": "host"}, 1},
		{"cage_team_quota", map[string]string{"team": "alpha", "resource": "sandboxes"}, 2},
		{"cage_team_usage", map[string]string{"team": "alpha", "resource": "sandboxes"}, 1},
		{"cage_sandboxes_max", nil, sample(fams, "cage_sandboxes_max", nil)},
	} {
		if got := sample(fams, c.name, c.labels); got != c.want || got < 0 {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if oomKills < 1 {
		t.Errorf("the OOM entry counts no kill: %+v", oom)
	}
	if t.Failed() {
		t.Logf("the scrape:\n%s", text)
	}
	for _, name := range []string{"go_goroutines", "process_open_fds", "process_resident_memory_bytes", "cage_host_memory_bytes",
		"cage_sandboxes_committed", "cage_host_disk_free_bytes"} {
		if sample(fams, name, nil) <= 0 {
			t.Errorf("%s missing or zero", name)
		}
	}
	if in, out := sample(fams, "cage_proxy_bytes_total", map[string]string{"direction": "in"}),
		sample(fams, "cage_proxy_bytes_total", map[string]string{"direction": "out"}); in <= 0 || out <= 0 {
		t.Errorf("proxy bytes in %v, out %v", in, out)
	}
	// No tenant's id: sandboxes, keys, teams.
	var keys types.AuditPage
	d.expect(t, http.StatusOK, call{method: "GET", path: "/audit?limit=1", key: alpha}).decode(t, &keys)
	for _, id := range []string{sb1.SandboxID, sb2.SandboxID, small.SandboxID, sb1.EnvdAccessToken, keys.Entries[0].KeyID, keys.Entries[0].TeamID} {
		if id != "" && strings.Contains(text, id) {
			t.Errorf("the scrape names %q", id)
		}
	}

	// The door: its token only, and nothing on the API's listener.
	for _, tok := range []string{"", "wrong-token-0123456789abcdef"} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+maddr+"/metrics", nil)
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("/metrics with token %q: %d, want 401", tok, resp.StatusCode)
		}
	}
	for _, key := range []string{"", d.key} {
		req, _ := http.NewRequest(http.MethodGet, d.apiURL()+"/metrics", nil)
		if key != "" {
			req.Header.Set("X-API-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET /metrics on the API listener (key %v): %d, want 404", key != "", resp.StatusCode)
		}
	}
}
