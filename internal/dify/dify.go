// Package dify serves Dify's sandbox API (langgenius/dify-sandbox's routes,
// envelope and run result), so that Dify's code nodes run in cage
// sandboxes: point Dify's CODE_EXECUTION_ENDPOINT at `cage serve --dify
// ADDR` and CODE_EXECUTION_API_KEY at the key of the config's dify section.
//
// Routes: GET /health (no key), and under /v1/sandbox/ with X-Api-Key
// (compared in constant time before a byte of the body is read; 401 with an
// empty body otherwise): POST run, GET dependencies, POST
// dependencies/update, GET dependencies/refresh. Answers are Dify's
// envelope {code, message, data}. Each run takes a fresh sandbox of the
// configured template and wall from the daemon's manager (so from its
// pool, with a record, limits, a network policy and audit entries like any
// sandbox's), feeds the code to python3 or node on its standard input,
// waits at most the configured time, answers {stdout, stderr, error,
// exit_code} and kills the sandbox.
//
// Overload is bounded twice, as dify-sandbox does: at most MaxRequests runs
// are in flight (beyond, 503 with the envelope), of which at most
// MaxWorkers have a sandbox at once (the others wait their turn).
package dify

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

// KeyID owns the sandboxes of Dify's runs in the store: no API key's id
// (those are "key_" + hex), so no tenant of the control API sees them.
const KeyID = "dify"

// Defaults of Config.
const (
	DefaultTemplate    = "base"
	DefaultTimeout     = 15 * time.Second // Dify's compose sets WORKER_TIMEOUT=15
	DefaultMemory      = 256 << 20
	DefaultCPUs        = 1.0
	DefaultPids        = 128
	DefaultMaxRequests = 200
	DefaultMaxOutput   = 4 << 20  // per stream
	DefaultMaxBody     = 16 << 20 // a run's request
)

// Config configures the service. Zero values are the defaults.
type Config struct {
	Key      string        // what Dify sends as X-Api-Key (CODE_EXECUTION_API_KEY); required
	Template string        // the sandboxes' template (default base: python3 with jinja2, httpx, requests; node)
	Wall     string        // "" is the daemon's default wall
	Timeout  time.Duration // a run's wall time; its sandbox lives LifeMargin longer at most
	Memory   int64         // bytes
	CPUs     float64
	Pids     int64
	// Network is the policy of a run that asks for the network (Dify
	// always does); a run that does not gets none. Default: internet
	// (the always-denied ranges stay denied).
	Network     *network.Policy
	MaxRequests int   // runs in flight; beyond, 503
	MaxWorkers  int   // runs with a sandbox at once (default 4 per CPU)
	MaxOutput   int64 // bytes of stdout, and of stderr, kept per run, as the answer holds them (JSON)
	MaxBody     int64 // bytes of a request body
	// Audit is the audit trail (nil: none): every call under /v1/sandbox/
	// (api.call, refused ones the operator's), and each run (process.code:
	// its code, bounded, and hash, language, exit code, outcome).
	Audit *audit.Trail
}

// withDefaults fills c's zero values and checks the rest.
func (c Config) withDefaults() (Config, error) {
	if c.Key == "" {
		return c, errors.New("dify: a key is required (the CODE_EXECUTION_API_KEY Dify sends)")
	}
	if c.Template == "" {
		c.Template = DefaultTemplate
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Memory == 0 {
		c.Memory = DefaultMemory
	}
	if c.CPUs == 0 {
		c.CPUs = DefaultCPUs
	}
	if c.Pids == 0 {
		c.Pids = DefaultPids
	}
	if c.Network == nil {
		c.Network = &network.Policy{Mode: network.Internet}
	}
	if c.MaxRequests == 0 {
		c.MaxRequests = DefaultMaxRequests
	}
	if c.MaxWorkers == 0 {
		c.MaxWorkers = 4 * runtime.NumCPU()
	}
	if c.MaxOutput == 0 {
		c.MaxOutput = DefaultMaxOutput
	}
	if c.MaxBody == 0 {
		c.MaxBody = DefaultMaxBody
	}
	switch {
	case c.Timeout < time.Second || c.Timeout > time.Hour:
		return c, fmt.Errorf("dify: timeout %v: want 1s to 1h", c.Timeout)
	case c.Memory < 0 || c.CPUs < 0 || c.Pids < 0:
		return c, errors.New("dify: negative limits are not limits")
	case c.MaxRequests < 1 || c.MaxWorkers < 1 || c.MaxWorkers > c.MaxRequests:
		return c, fmt.Errorf("dify: want 1 <= max_workers (%d) <= max_requests (%d)", c.MaxWorkers, c.MaxRequests)
	case c.MaxOutput < 1 || c.MaxBody < 1:
		return c, errors.New("dify: max_output and max_body must be positive")
	}
	p := *c.Network
	if err := p.Validate(); err != nil {
		return c, fmt.Errorf("dify: network: %v", err)
	}
	c.Network = &p
	return c, nil
}

// Sandboxes is what a run needs of the daemon's manager.
type Sandboxes interface {
	Create(ctx context.Context, req manager.CreateRequest) (*store.Sandbox, error)
	Ready(ctx context.Context, id string, mayResume bool) (wall.Sandbox, error)
	Kill(keyID, id string) error
}

// Server is the Dify-compatible sandbox service.
type Server struct {
	cfg Config
	sbx Sandboxes
	log *slog.Logger
	key [sha256.Size]byte

	inflight atomic.Int64
	workers  chan struct{}
	bodies   chan struct{} // runs whose body is read: twice the workers
	// run executes one request (execute; the package's tests replace it).
	run func(ctx context.Context, req runRequest, client string) (*Result, error)
}

// New checks cfg and returns the service.
func New(cfg Config, sbx Sandboxes, log *slog.Logger) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, sbx: sbx, log: log, key: sha256.Sum256([]byte(cfg.Key)),
		workers: make(chan struct{}, cfg.MaxWorkers), bodies: make(chan struct{}, 2*cfg.MaxWorkers)}
	s.run = s.execute
	return s, nil
}

// Template is the template runs use.
func (s *Server) Template() string { return s.cfg.Template }

// Lifetime is the longest a run's sandbox lives: its timeout and
// LifeMargin.
func (s *Server) Lifetime() time.Duration { return s.cfg.Timeout + LifeMargin }

// Handler serves the routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandbox/run", s.handleRun)
	mux.HandleFunc("GET /v1/sandbox/dependencies", s.handleDependencies)
	mux.HandleFunc("POST /v1/sandbox/dependencies/update", s.handleUpdate)
	mux.HandleFunc("GET /v1/sandbox/dependencies/refresh", s.handleDependencies)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/health" && (r.Method == http.MethodGet || r.Method == http.MethodHead):
			w.Header().Set("Content-Type", "application/json; charset=utf-8")
			_, _ = w.Write([]byte(`"ok"`))
		case !strings.HasPrefix(r.URL.Path, "/v1/sandbox/"):
			http.NotFound(w, r)
		case !s.authorized(r):
			// dify-sandbox's answer: 401, no body. The body is never read.
			w.Header().Set("Connection", "close")
			w.WriteHeader(http.StatusUnauthorized)
			s.recordCall(mux, r, "", http.StatusUnauthorized)
		default:
			sw := &statusWriter{ResponseWriter: w}
			mux.ServeHTTP(sw, r)
			s.recordCall(mux, r, KeyID, sw.status)
		}
	})
}

// recordCall puts a call under /v1/sandbox/ in the audit trail: Dify's
// (KeyID) when it had the key, the operator's alone when refused.
func (s *Server) recordCall(mux *http.ServeMux, r *http.Request, key string, status int) {
	if s.cfg.Audit == nil {
		return
	}
	_, route := mux.Handler(r)
	if route == "" {
		route = r.Method + " (no such route)"
	}
	if status == 0 {
		status = http.StatusOK
	}
	s.cfg.Audit.Record(audit.Event{Kind: audit.KindAPICall, KeyID: key, Route: route, Status: status,
		Client: clientAddr(r), Detail: map[string]any{"via": "dify"}})
}

// statusWriter remembers the status a handler answered with.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// authorized compares X-Api-Key with the key in constant time (digests of
// both, so that not even the length shows).
func (s *Server) authorized(r *http.Request) bool {
	got := sha256.Sum256([]byte(r.Header.Get("X-Api-Key")))
	return subtle.ConstantTimeCompare(got[:], s.key[:]) == 1
}

// envelope is Dify's answer: code 0 and "success", or a negative code and
// a message with data null.
type envelope struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
	Data    any    `json:"data"`
}

func writeJSON(w http.ResponseWriter, status int, v envelope) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"code":-500,"message":"internal error","data":null}`)
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func writeOK(w http.ResponseWriter, data any) {
	writeJSON(w, http.StatusOK, envelope{Code: 0, Message: "success", Data: data})
}

func writeError(w http.ResponseWriter, status, code int, msg string) {
	writeJSON(w, status, envelope{Code: code, Message: msg, Data: nil})
}

func (s *Server) handleRun(w http.ResponseWriter, r *http.Request) {
	if s.inflight.Add(1) > int64(s.cfg.MaxRequests) {
		s.inflight.Add(-1)
		writeError(w, http.StatusServiceUnavailable, -503, "Too many requests")
		return
	}
	defer s.inflight.Add(-1)
	// A run's body (up to max_body) is read only once the run is among
	// the next to get a worker: the requests waiting beyond those hold
	// their connection, not their code (before, all of max_requests held
	// theirs: 200 of 16 MiB, 3.2 GiB).
	select {
	case s.bodies <- struct{}{}:
	case <-r.Context().Done():
		return
	}
	defer func() { <-s.bodies }()
	var req runRequest
	if status, err := bind(w, r, &req, s.cfg.MaxBody); err != nil {
		writeError(w, status, -400, err.Error())
		return
	}
	if req.Language != "python3" && req.Language != "nodejs" {
		writeError(w, http.StatusBadRequest, -400, "unsupported language")
		return
	}
	res, err := s.run(r.Context(), req, clientAddr(r))
	switch {
	case err == nil:
		writeOK(w, res)
	case r.Context().Err() != nil:
		// Dify went away; its run was stopped and nobody reads an answer.
	case errors.Is(err, manager.ErrLimit):
		writeError(w, http.StatusServiceUnavailable, -503, "Too many requests: "+err.Error())
	default:
		id := ids.NewToken()[:12]
		s.log.Error("dify: run", "request", id, "err", err)
		writeError(w, http.StatusOK, -500, "the sandbox could not run the code (request "+id+" in cage's log)")
	}
}

// dependency is an entry of the dependency routes' list.
type dependency struct {
	Name    string `json:"name"`
	Version string `json:"version"`
}

// builtins are the Python packages Dify's runners need, which the template
// holds (dify-sandbox lists them so, with no version).
var builtins = []dependency{{"jinja2", ""}, {"httpx", ""}, {"requests", ""}}

func (s *Server) handleDependencies(w http.ResponseWriter, r *http.Request) {
	if !s.pythonOnly(w, r) {
		return
	}
	writeOK(w, map[string]any{"dependencies": builtins})
}

// handleUpdate answers dify-sandbox's dependency update: the packages are
// the template's, so there is nothing to install (build a template with
// more and name it in the config).
func (s *Server) handleUpdate(w http.ResponseWriter, r *http.Request) {
	if !s.pythonOnly(w, r) {
		return
	}
	writeOK(w, map[string]any{})
}

// pythonOnly binds the dependency routes' request: only python3 has any.
// Its body is a language's name, read up to maxLanguageBody: these routes
// take no worker and no place among the runs' bodies, so a body of
// max_body each (16 MiB) let the key's holder grow the daemon's memory
// with every connection (found by review: 32 at once, 1.3 GB).
func (s *Server) pythonOnly(w http.ResponseWriter, r *http.Request) bool {
	var req langRequest
	if status, err := bind(w, r, &req, min(s.cfg.MaxBody, maxLanguageBody)); err != nil {
		writeError(w, status, -400, err.Error())
		return false
	}
	if req.Language != "python3" {
		writeError(w, http.StatusBadRequest, -400, "unsupported language")
		return false
	}
	return true
}

// maxLanguageBody bounds the dependency routes' bodies.
const maxLanguageBody = 4 << 10

func clientAddr(r *http.Request) string {
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}
