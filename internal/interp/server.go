// Package interp is cage's code interpreter: the server inside a sandbox of
// the code-interpreter-v1 template that @e2b/code-interpreter talks to on
// port 49999 (through cage's proxy). It keeps code contexts, each a kernel
// holding a language's state between runs, and streams a run's output as
// E2B's NDJSON lines (POST /execute). Python and R run on real Jupyter
// kernels (ipykernel, IRkernel) spoken to over ZeroMQ by package jupyter;
// JavaScript and TypeScript on a Node.js kernel of cage's own (node.go,
// nodekernel.js); bash on a bash process (bash.go).
//
// The server runs as the sandbox's user and is no security boundary: code
// it runs can do what the server can. What guards it is the proxy on the
// host (docs/SECURITY.md). It bounds what a client can make it hold: the
// request body, the contexts, a run's output.
package interp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
)

// Defaults of Config.
const (
	DefaultCwd         = "/home/user"
	DefaultMaxContexts = 32
	DefaultMaxOutput   = 16 << 20
	DefaultMaxRequest  = 4 << 20
)

// Config configures a Server.
type Config struct {
	// Cwd is where contexts start when their creator names no directory.
	Cwd string
	// MaxContexts bounds the contexts alive at once (each is a process).
	MaxContexts int
	// MaxOutput bounds the output one run sends (stdout, stderr, results).
	MaxOutput int64
	// MaxRequest bounds a request's body (the code of a run).
	MaxRequest int64
	// Languages are the languages the server runs (nil: Languages()).
	Languages map[string]Language
	Log       *slog.Logger
}

// Server is the code interpreter's HTTP server.
type Server struct {
	cfg   Config
	log   *slog.Logger
	ready atomic.Bool

	mu       sync.Mutex
	contexts map[string]*codeContext
	defaults map[string]*codeContext // a language's default context
	creating map[string]*sync.Mutex  // held while a language's default is made
	starting int                     // contexts whose kernel is starting (newContext)
}

// New returns a server; call Prestart, then serve Handler.
func New(cfg Config) *Server {
	if cfg.Cwd == "" {
		cfg.Cwd = DefaultCwd
	}
	if cfg.MaxContexts <= 0 {
		cfg.MaxContexts = DefaultMaxContexts
	}
	if cfg.MaxOutput <= 0 {
		cfg.MaxOutput = DefaultMaxOutput
	}
	if cfg.MaxRequest <= 0 {
		cfg.MaxRequest = DefaultMaxRequest
	}
	if cfg.Languages == nil {
		cfg.Languages = Languages()
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Server{cfg: cfg, log: cfg.Log, contexts: map[string]*codeContext{},
		defaults: map[string]*codeContext{}, creating: map[string]*sync.Mutex{}}
}

// Prestart makes the default contexts of langs (their kernels started) and
// then lets /health answer: a sandbox is ready when its first run need not
// wait for a kernel. A language that fails is logged; its first run tries
// again and reports why.
func (s *Server) Prestart(ctx context.Context, langs ...string) {
	for _, l := range langs {
		if _, err := s.defaultContext(ctx, l); err != nil {
			s.log.Warn("default context", "language", l, "err", err)
		}
	}
	s.ready.Store(true)
}

// Handler serves E2B's code interpreter routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.health)
	mux.HandleFunc("POST /execute", s.execute)
	mux.HandleFunc("GET /contexts", s.listContexts)
	mux.HandleFunc("POST /contexts", s.createContext)
	mux.HandleFunc("POST /contexts/{id}/restart", s.restartContext)
	mux.HandleFunc("DELETE /contexts/{id}", s.removeContext)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// E2B's server answers browsers from any origin; the proxy in
		// front of it decides who may reach it at all.
		w.Header().Set("Access-Control-Allow-Origin", "*")
		if r.Method == http.MethodOptions {
			w.Header().Set("Access-Control-Allow-Methods", "GET, POST, DELETE")
			w.Header().Set("Access-Control-Allow-Headers", "*")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	if !s.ready.Load() {
		writeJSON(w, http.StatusServiceUnavailable, "starting")
		return
	}
	writeJSON(w, http.StatusOK, "OK")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeText answers with a one-line plain-text error, as E2B's server does.
func writeText(w http.ResponseWriter, status int, format string, args ...any) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, fmt.Sprintf(format, args...))
}

// decodeBody reads a JSON body of at most MaxRequest bytes into v; it
// answers the request itself when it fails (413, or 422 as E2B's FastAPI
// does for a body that is no JSON of the right shape).
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any, optional bool) bool {
	body := http.MaxBytesReader(w, r.Body, s.cfg.MaxRequest)
	data, err := io.ReadAll(body)
	var tooBig *http.MaxBytesError
	if errors.As(err, &tooBig) {
		writeText(w, http.StatusRequestEntityTooLarge, "request body is larger than %d bytes (the code interpreter's limit; write data to a file with sandbox.files.write instead)", s.cfg.MaxRequest)
		return false
	}
	if err != nil {
		writeText(w, http.StatusBadRequest, "reading the request body: %v", err)
		return false
	}
	if optional && len(strings.TrimSpace(string(data))) == 0 {
		return true
	}
	if err := json.Unmarshal(data, v); err != nil {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"detail": "the body is not the JSON object this route takes: " + err.Error()})
		return false
	}
	return true
}

// contextJSON is E2B's Context.
type contextJSON struct {
	ID       string `json:"id"`
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

func (s *Server) listContexts(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	out := make([]contextJSON, 0, len(s.contexts))
	for _, c := range s.contexts {
		out = append(out, c.json())
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) createContext(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Language *string `json:"language"`
		Cwd      *string `json:"cwd"`
	}
	if !s.decodeBody(w, r, &req, true) {
		return
	}
	lang, cwd := "", s.cfg.Cwd
	if req.Language != nil {
		lang = *req.Language
	}
	if req.Cwd != nil && *req.Cwd != "" {
		cwd = *req.Cwd
	}
	c, err := s.newContext(r.Context(), lang, cwd)
	if err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, c.json())
}

func (s *Server) restartContext(w http.ResponseWriter, r *http.Request) {
	c := s.context(r.PathValue("id"))
	if c == nil {
		writeText(w, http.StatusNotFound, "Context %s not found", r.PathValue("id"))
		return
	}
	if err := c.restart(r.Context()); err != nil {
		s.log.Warn("restart context", "context", c.ID, "err", err)
		writeText(w, http.StatusInternalServerError, "Failed to restart context %s: %v", c.ID, err)
		return
	}
	writeJSON(w, http.StatusOK, nil)
}

func (s *Server) removeContext(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	s.mu.Lock()
	c := s.contexts[id]
	if c != nil {
		delete(s.contexts, id)
		if s.defaults[c.Language] == c {
			delete(s.defaults, c.Language)
		}
	}
	s.mu.Unlock()
	if c == nil {
		writeText(w, http.StatusNotFound, "Context %s not found", id)
		return
	}
	c.remove()
	writeJSON(w, http.StatusOK, nil)
}

// errBadRequest and errLimit are kinds of errors answered 400 and 429.
var (
	errBadRequest = errors.New("bad request")
	errLimit      = errors.New("limit reached")
)

// fail answers err as its kind's status, its text as the body.
func (s *Server) fail(w http.ResponseWriter, err error) {
	msg := err.Error()
	switch {
	case errors.Is(err, errBadRequest):
		writeText(w, http.StatusBadRequest, "%s", strings.TrimPrefix(msg, errBadRequest.Error()+": "))
	case errors.Is(err, errLimit):
		writeText(w, http.StatusTooManyRequests, "%s", strings.TrimPrefix(msg, errLimit.Error()+": "))
	default:
		writeText(w, http.StatusInternalServerError, "%s", msg)
	}
}
