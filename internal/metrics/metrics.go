// Package metrics is the daemon's Prometheus metrics (the text format,
// written by cage itself: expo.go), served on a listener of their own
// (`cage serve --metrics ADDR`, off by default) for the operator, never
// on the API: what a tenant can reach shows no metrics.
//
// No metric carries a sandbox's id, a key's or a volume's: labels are
// bounded sets (states, walls, templates of the store, routes of the
// API's own table, envd RPC names from a fixed list, quota names), so
// neither the series count nor what a scrape reveals grows with what
// tenants do. Teams appear by name only in the quota gauges.
//
// Counting is a map lookup and an add under a vector's lock on the paths
// it watches (an API call, a proxied request, a create); what is read from the store and the host
// (sandboxes by state, pools, headroom) is read when Prometheus scrapes,
// from the State the daemon adds, as are the Go runtime's and the
// process's own figures. A nil *Metrics counts nothing, so callers need no
// checks.
package metrics

import (
	"bytes"
	"crypto/subtle"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Metrics is the counters the daemon's parts update and what it reads at
// each scrape.
type Metrics struct {
	apiRequests  *vec // route, code
	apiSeconds   *vec // route (histogram)
	rateLimited  *vec // limit: requests, creates
	quotaRefused *vec // quota
	creates      *vec // wall, result
	createSecs   *vec // wall (histogram)
	resumes      *vec // kind, result
	resumeSecs   *vec // kind (histogram)
	ends         *vec // reason
	limitHits    *vec // limit: oom, pids
	netDecisions *vec // kind, decision
	proxyReqs    *vec // port, rpc, code
	proxyBytes   *vec // direction

	mu     sync.Mutex
	states []State
}

// latencyBuckets span a pooled create (ms) to a cold microVM (s).
var latencyBuckets = []float64{.002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30}

// New makes the daemon's counters; a scrape also shows the Go runtime's
// and the process's own figures (goroutines, heap, open descriptors,
// resident memory).
func New() *Metrics {
	m := &Metrics{}
	counter := func(name, help string, labels ...string) *vec {
		return newVec("cage_"+name, help, nil, labels...)
	}
	hist := func(name, help string, labels ...string) *vec {
		return newVec("cage_"+name, help, latencyBuckets, labels...)
	}
	m.apiRequests = counter("api_requests_total", "Control API calls answered, by route and status.", "route", "code")
	m.apiSeconds = hist("api_request_duration_seconds", "Control API calls' time to answer (a create's includes its sandbox's start).", "route")
	m.rateLimited = counter("api_rate_limited_total", "API calls refused with 429 by a key's rate limit.", "limit")
	m.quotaRefused = counter("quota_refused_total", "Creates, resumes and pauses refused by a team's quota.", "quota")
	m.creates = counter("sandbox_creates_total", "Sandbox creates, by wall and result (ok, error).", "wall", "result")
	m.createSecs = hist("sandbox_create_duration_seconds", "Time to create a sandbox (recorded and started), successful creates.", "wall")
	m.resumes = counter("sandbox_resumes_total", "Resumes of paused sandboxes, by how they were paused and result.", "kind", "result")
	m.resumeSecs = hist("sandbox_resume_duration_seconds", "Time to resume a paused sandbox, successful resumes.", "kind")
	m.ends = counter("sandbox_ends_total", "Sandboxes ended, by why: kill, timeout, died, removed.", "reason")
	m.limitHits = counter("sandbox_limit_hits_total", "Processes killed by a sandbox's memory limit (oom) and forks refused by its pids limit (pids), from the host cgroups.", "limit")
	m.netDecisions = counter("network_decisions_total", "Sandbox network decisions (connections and DNS answers) allowed and denied, as the host logged them.", "kind", "decision")
	m.proxyReqs = counter("proxy_requests_total", "Requests the sandbox-traffic proxy answered, by port (envd, interp, port), envd RPC and status.", "port", "rpc", "code")
	m.proxyBytes = counter("proxy_bytes_total", "Bytes through the proxy: in (client to sandbox, request bodies), out (sandbox to client, responses). Upgraded connections (WebSocket) are not counted.", "direction")
	return m
}

// families is everything a scrape shows.
func (m *Metrics) families() []*family {
	var fams []*family
	for _, v := range []*vec{m.apiRequests, m.apiSeconds, m.rateLimited, m.quotaRefused, m.creates, m.createSecs,
		m.resumes, m.resumeSecs, m.ends, m.limitHits, m.netDecisions, m.proxyReqs, m.proxyBytes} {
		if f := v.family(); f != nil {
			fams = append(fams, f)
		}
	}
	m.mu.Lock()
	states := m.states
	m.mu.Unlock()
	for _, s := range states {
		fams = append(fams, s.families()...)
	}
	fams = append(fams, goFamilies()...)
	return append(fams, processFamilies()...)
}

// Handler serves the metrics in Prometheus's text format; with a token,
// only to a request that carries it as `Authorization: Bearer TOKEN`
// (compared in constant time; 401 otherwise). Without one (a loopback
// listener), only to a request for an IP address or localhost: a page in
// a browser on the host that rebinds a name of its own to 127.0.0.1 sends
// that name as the Host, and would read the scrape as its own origin's.
func (m *Metrics) Handler(token string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		if token != "" {
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="cage metrics"`)
				http.Error(w, "missing or wrong bearer token", http.StatusUnauthorized)
				return
			}
		} else if !localHost(r.Host) {
			http.Error(w, "metrics without a token are served to an IP address or localhost only (a scraper elsewhere: metrics.token_file)", http.StatusForbidden)
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			http.Error(w, "GET only", http.StatusMethodNotAllowed)
			return
		}
		var b bytes.Buffer
		if err := writeText(&b, m.families()); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		w.Header().Set("Content-Length", strconv.Itoa(b.Len()))
		if r.Method == http.MethodGet {
			_, _ = w.Write(b.Bytes())
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	return mux
}

// localHost says whether a request's Host names an IP address or
// localhost, with or without a port: never a name a page could have
// rebound to the listener.
func localHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	return strings.EqualFold(host, "localhost")
}

// APICall counts an answered API call; route is the mux's pattern (a
// bounded set), "" for none.
func (m *Metrics) APICall(route string, status int, d time.Duration) {
	if m == nil {
		return
	}
	if route == "" {
		route = "none"
	}
	m.apiRequests.add(1, route, strconv.Itoa(status))
	m.apiSeconds.observe(d.Seconds(), route)
}

// RateLimited counts a call refused by a rate: a key's "requests" or
// "creates", "content" (a volume owner's content requests), or "lists"
// (an owner's list requests in flight).
func (m *Metrics) RateLimited(limit string) {
	if m != nil {
		m.rateLimited.add(1, limit)
	}
}

// QuotaRefused counts a refusal by a team's quota (sandboxes, cpus,
// memory, disk, paused).
func (m *Metrics) QuotaRefused(quota string) {
	if m != nil {
		m.quotaRefused.add(1, quota)
	}
}

func result(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

// Created counts a create on wall and, when it succeeded, its time.
func (m *Metrics) Created(wall string, d time.Duration, err error) {
	if m == nil {
		return
	}
	m.creates.add(1, wall, result(err))
	if err == nil {
		m.createSecs.observe(d.Seconds(), wall)
	}
}

// Resumed counts a resume of a sandbox paused as kind and, when it
// succeeded, its time.
func (m *Metrics) Resumed(kind string, d time.Duration, err error) {
	if m == nil {
		return
	}
	m.resumes.add(1, kind, result(err))
	if err == nil {
		m.resumeSecs.observe(d.Seconds(), kind)
	}
}

// Ended counts a sandbox's end: kill, timeout, died or removed.
func (m *Metrics) Ended(reason string) {
	if m != nil {
		m.ends.add(1, reason)
	}
}

// LimitHits counts n hits of a sandbox's limit: "oom" or "pids".
func (m *Metrics) LimitHits(limit string, n uint64) {
	if m != nil && n > 0 {
		m.limitHits.add(float64(n), limit)
	}
}

// NetDecision counts a network decision: kind connect or dns, decision
// allow or deny.
func (m *Metrics) NetDecision(kind, decision string) {
	if m == nil {
		return
	}
	if kind != "dns" {
		kind = "connect"
	}
	if decision != "allow" {
		decision = "deny"
	}
	m.netDecisions.add(1, kind, decision)
}

// ProxyRequest counts a request the proxy answered, with its bytes.
func (m *Metrics) ProxyRequest(port int, path string, status int, in, out int64) {
	if m == nil {
		return
	}
	class, rpc := "port", ""
	switch port {
	case EnvdPort:
		class, rpc = "envd", envdRPC(path)
	case InterpPort:
		class = "interp"
	}
	// The status is the sandbox's answer's, any three digits: one HTTP
	// does not name is "other", so a sandbox cannot mint series (900
	// codes a class, 21,600 under the agent's RPCs, found by review,
	// 2026-12-04).
	code := "other"
	if http.StatusText(status) != "" {
		code = strconv.Itoa(status)
	}
	m.proxyReqs.add(1, class, rpc, code)
	if in > 0 {
		m.proxyBytes.add(float64(in), "in")
	}
	if out > 0 {
		m.proxyBytes.add(float64(out), "out")
	}
}

// The ports the proxy tells apart (proxy.EnvdPort, proxy.InterpPort).
const (
	EnvdPort   = 49983
	InterpPort = 49999
)

// envdRPCs are the agent's routes a label may name; any other path is
// "other", so a client cannot mint series.
var envdRPCs = map[string]bool{"/files": true, "/health": true, "/envs": true, "/init": true, "/metrics": true}

func init() {
	for _, m := range []string{"Start", "Connect", "List", "SendInput", "StreamInput", "SendSignal", "Update", "CloseStdin"} {
		envdRPCs["/process.Process/"+m] = true
	}
	for _, m := range []string{"Stat", "MakeDir", "Move", "ListDir", "Remove", "WatchDir", "CreateWatcher",
		"GetWatcherEvents", "RemoveWatcher"} {
		envdRPCs["/filesystem.Filesystem/"+m] = true
	}
}

func envdRPC(path string) string {
	if envdRPCs[path] {
		return path
	}
	return "other"
}
