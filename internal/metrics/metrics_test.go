package metrics

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Scrape fetches and parses the handler's text with Prometheus's own
// parser.
func Scrape(t testing.TB, url, token string) map[string]*dto.MetricFamily {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("Accept", "text/plain")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	return fams
}

// value is the sample of family name whose labels include want (a
// counter's or gauge's value, a histogram's count); -1 when absent.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
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

func TestCountersAndState(t *testing.T) {
	m := New()
	m.APICall("POST /v2/sandboxes", 201, 20*time.Millisecond)
	m.APICall("POST /v2/sandboxes", 201, 30*time.Millisecond)
	m.APICall("", 404, time.Millisecond)
	m.RateLimited("creates")
	m.QuotaRefused("sandboxes")
	m.Created("process", 15*time.Millisecond, nil)
	m.Created("process", 0, errors.New("no"))
	m.Resumed("files", time.Second, nil)
	m.Ended("timeout")
	m.LimitHits("oom", 2)
	m.LimitHits("pids", 0)
	m.NetDecision("connect", "deny")
	m.NetDecision("dns", "allow")
	m.ProxyRequest(EnvdPort, "/process.Process/Start", 200, 100, 2000)
	m.ProxyRequest(EnvdPort, "/made-up/path/1", 404, 0, 10)
	m.ProxyRequest(8080, "/x", 200, 5, 0)
	m.AddState(State{
		Sandboxes: func() ([]SandboxGroup, error) {
			return []SandboxGroup{{"running", "process", "base", 3}, {"paused", "runc", "snapshot", 1}}, nil
		},
		Pools:    func() []Pool { return []Pool{{"base", "process", 2, 4, 10, 1}} },
		Headroom: func() Headroom { return Headroom{CPUs: 2, MemTotal: 8 << 30, MaxSandboxes: 16, LiveSandboxes: 4} },
		Teams: func() ([]TeamUse, error) {
			return []TeamUse{{Name: "alpha", Quota: map[string]float64{"sandboxes": 3}, Usage: map[string]float64{"sandboxes": 2}}}, nil
		},
	})
	var nilM *Metrics
	nilM.APICall("x", 200, 0) // a nil Metrics counts nothing, and does not panic
	srv := httptest.NewServer(m.Handler("s3cret"))
	defer srv.Close()

	for _, tok := range []string{"", "wrong"} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/metrics", nil)
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("token %q: %d, want 401", tok, resp.StatusCode)
		}
	}
	fams := Scrape(t, srv.URL+"/metrics", "s3cret")
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"cage_api_requests_total", map[string]string{"route": "POST /v2/sandboxes", "code": "201"}, 2},
		{"cage_api_requests_total", map[string]string{"route": "none", "code": "404"}, 1},
		{"cage_api_request_duration_seconds", map[string]string{"route": "POST /v2/sandboxes"}, 2},
		{"cage_api_rate_limited_total", map[string]string{"limit": "creates"}, 1},
		{"cage_quota_refused_total", map[string]string{"quota": "sandboxes"}, 1},
		{"cage_sandbox_creates_total", map[string]string{"wall": "process", "result": "ok"}, 1},
		{"cage_sandbox_creates_total", map[string]string{"wall": "process", "result": "error"}, 1},
		{"cage_sandbox_create_duration_seconds", map[string]string{"wall": "process"}, 1},
		{"cage_sandbox_resume_duration_seconds", map[string]string{"kind": "files"}, 1},
		{"cage_sandbox_ends_total", map[string]string{"reason": "timeout"}, 1},
		{"cage_sandbox_limit_hits_total", map[string]string{"limit": "oom"}, 2},
		{"cage_sandbox_limit_hits_total", map[string]string{"limit": "pids"}, -1},
		{"cage_network_decisions_total", map[string]string{"kind": "connect", "decision": "deny"}, 1},
		{"cage_network_decisions_total", map[string]string{"kind": "dns", "decision": "allow"}, 1},
		{"cage_proxy_requests_total", map[string]string{"port": "envd", "rpc": "/process.Process/Start", "code": "200"}, 1},
		{"cage_proxy_requests_total", map[string]string{"port": "envd", "rpc": "other", "code": "404"}, 1},
		{"cage_proxy_requests_total", map[string]string{"port": "port", "code": "200"}, 1},
		{"cage_proxy_bytes_total", map[string]string{"direction": "in"}, 105},
		{"cage_proxy_bytes_total", map[string]string{"direction": "out"}, 2010},
		{"cage_sandboxes", map[string]string{"state": "running", "wall": "process", "template": "base"}, 3},
		{"cage_sandboxes", map[string]string{"state": "paused", "template": "snapshot"}, 1},
		{"cage_pool_ready", map[string]string{"template": "base"}, 2},
		{"cage_pool_misses_total", map[string]string{"template": "base"}, 1},
		{"cage_host_cpus", nil, 2},
		{"cage_host_memory_bytes", map[string]string{"kind": "total"}, 8 << 30},
		{"cage_sandboxes_max", nil, 16},
		{"cage_team_quota", map[string]string{"team": "alpha", "resource": "sandboxes"}, 3},
		{"cage_team_usage", map[string]string{"team": "alpha", "resource": "sandboxes"}, 2},
	} {
		if got := value(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	for _, name := range []string{"go_goroutines", "process_open_fds", "process_resident_memory_bytes"} {
		if value(fams, name, nil) <= 0 {
			t.Errorf("%s missing or zero", name)
		}
	}
	if fams["cage_proxy_requests_total"] != nil {
		for _, m := range fams["cage_proxy_requests_total"].Metric {
			for _, l := range m.Label {
				if l.GetValue() == "/made-up/path/1" {
					t.Error("a client's path became a label")
				}
			}
		}
	}
}

// TestExpositionHostileLabel: a label value (a team's name, set by an
// admin) with quotes, backslashes and newlines stays one label value: the
// page still parses, the value comes back whole, and no series is injected.
func TestExpositionHostileLabel(t *testing.T) {
	m := New()
	evil := "a\"b\\c\n} 1\ncage_injected 1\n# TYPE x counter"
	teams := func() ([]TeamUse, error) {
		return []TeamUse{{Name: evil, Quota: map[string]float64{"sandboxes": 3}}}, nil
	}
	// Two states: families of one name go under one header.
	m.AddState(State{Teams: teams})
	m.AddState(State{Teams: func() ([]TeamUse, error) {
		return []TeamUse{{Name: "beta", Quota: map[string]float64{"cpus": 2}}}, nil
	}})
	srv := httptest.NewServer(m.Handler(""))
	defer srv.Close()
	fams := Scrape(t, srv.URL+"/metrics", "")
	if got := value(fams, "cage_team_quota", map[string]string{"team": evil, "resource": "sandboxes"}); got != 3 {
		t.Errorf("the hostile team's quota: %v, want 3", got)
	}
	if got := value(fams, "cage_team_quota", map[string]string{"team": "beta", "resource": "cpus"}); got != 2 {
		t.Errorf("the second state's team: %v, want 2", got)
	}
	if fams["cage_injected"] != nil || fams["x"] != nil {
		t.Error("a label value injected a series")
	}
}

// TestHistogramBuckets: a bucket counts the observations at most its
// bound, cumulatively; +Inf counts them all; the sum is theirs.
func TestHistogramBuckets(t *testing.T) {
	m := New()
	for _, d := range []time.Duration{time.Millisecond, 10 * time.Millisecond, 11 * time.Millisecond, time.Minute} {
		m.Created("runc", d, nil)
	}
	srv := httptest.NewServer(m.Handler(""))
	defer srv.Close()
	f := Scrape(t, srv.URL+"/metrics", "")["cage_sandbox_create_duration_seconds"]
	if f == nil || len(f.Metric) != 1 || f.Metric[0].Histogram == nil {
		t.Fatalf("histogram: %v", f)
	}
	h := f.Metric[0].Histogram
	want := map[float64]uint64{.002: 1, .005: 1, .01: 2, .02: 3, 30: 3}
	for _, b := range h.Bucket {
		if n, ok := want[b.GetUpperBound()]; ok && b.GetCumulativeCount() != n {
			t.Errorf("bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), n)
		}
	}
	if h.GetSampleCount() != 4 {
		t.Errorf("count %d, want 4", h.GetSampleCount())
	}
	if s := h.GetSampleSum(); s < 60.021 || s > 60.023 {
		t.Errorf("sum %v, want 60.022", s)
	}
}

// TestRuntimeFamilies: the Go runtime's and the process's own figures are
// this process's.
func TestRuntimeFamilies(t *testing.T) {
	srv := httptest.NewServer(New().Handler(""))
	defer srv.Close()
	fams := Scrape(t, srv.URL+"/metrics", "")
	now := float64(time.Now().Unix())
	if st := value(fams, "process_start_time_seconds", nil); st < now-24*3600 || st > now+5 {
		t.Errorf("process_start_time_seconds %v, now %v", st, now)
	}
	if value(fams, "process_cpu_seconds_total", nil) < 0 { // 0 in a test this short
		t.Error("process_cpu_seconds_total missing")
	}
	for _, name := range []string{"process_max_fds", "process_virtual_memory_bytes",
		"go_threads", "go_memstats_heap_alloc_bytes", "go_memstats_sys_bytes"} {
		if value(fams, name, nil) <= 0 {
			t.Errorf("%s missing or zero", name)
		}
	}
	if value(fams, "go_info", map[string]string{"version": runtime.Version()}) != 1 {
		t.Error("go_info does not name this runtime's version")
	}
	if f := fams["go_gc_duration_seconds"]; f == nil || f.Metric[0].Summary == nil {
		t.Error("go_gc_duration_seconds is not a summary")
	}
}

// Attack: a sandbox's servers (its agent, its code interpreter, any port)
// answer with every status net/http's client takes, 100 to 999. Expected:
// the proxy's counts name only the statuses HTTP names, the rest under
// code "other", so the sandbox mints no series (before: one a status, 900
// a port class and 21,600 under the agent's RPC names).
func TestProxyStatusesMintNoSeries(t *testing.T) {
	m := New()
	for status := 100; status <= 999; status++ {
		m.ProxyRequest(EnvdPort, "/process.Process/Start", status, 0, 0)
		m.ProxyRequest(InterpPort, "/execute", status, 0, 0)
		m.ProxyRequest(6080, "/websockify", status, 0, 0)
	}
	srv := httptest.NewServer(m.Handler(""))
	defer srv.Close()
	fams := Scrape(t, srv.URL+"/metrics", "")
	f := fams["cage_proxy_requests_total"]
	if f == nil {
		t.Fatal("no cage_proxy_requests_total")
	}
	if n := len(f.Metric); n > 3*70 {
		t.Errorf("%d series for 900 statuses on 3 ports, want at most %d", n, 3*70)
	}
	if got := value(fams, "cage_proxy_requests_total", map[string]string{"port": "interp", "rpc": "", "code": "other"}); got < 800 {
		t.Errorf("statuses HTTP does not name, on the interpreter's port: %v under other, want them all", got)
	}
	if got := value(fams, "cage_proxy_requests_total", map[string]string{"port": "interp", "rpc": "", "code": "404"}); got != 1 {
		t.Errorf("404 on the interpreter's port: %v, want 1", got)
	}
}
