// Package ui is cage's web dashboard, served by `cage serve` under /ui on
// the control API's listener: server-side Go (net/http) and static assets
// embedded in the binary (static/; xterm.js is vendored from npm by
// `make ui`, and test/ui checks the copy matches the pinned release).
//
// Signing in takes an API key and gives a session: a random id in a cookie
// (HttpOnly, SameSite=Strict, Secure over TLS, Path=/ui) that names a
// record kept here, in memory, with the key; it ends after an idle spell,
// at an absolute age, or at sign-out. The UI acts exactly as its key: every
// read and change goes through the control API's own handler with the
// session's key in X-API-Key (so authentication, team isolation, admin
// checks, rates and the audit trail are the API's), and a sandbox's agent
// is reached through the daemon's proxy with the access token the API gave
// that key. Every request that changes anything carries the session's CSRF
// token in X-CSRF-Token, and a browser's Origin must be this host.
//
// Pages are built in the browser from JSON with textContent, never HTML
// strings, under a Content-Security-Policy without inline scripts.
package ui

import (
	"context"
	"embed"
	"errors"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

//go:embed static
var staticFS embed.FS

// Identity is what a key is, as sign-in shows it.
type Identity struct {
	KeyID  string `json:"keyID"`
	Name   string `json:"name"`
	TeamID string `json:"teamID,omitempty"`
	Admin  bool   `json:"admin"`
}

// Config configures the dashboard.
type Config struct {
	// API is the control API's handler (api.Handler): every call the UI
	// makes for a session goes through it with the session's key.
	API http.Handler
	// Proxy is the sandbox proxy's URL as this process dials it
	// (http://127.0.0.1:3001): terminals and files reach agents there.
	Proxy string
	// Dial, when set, is how this process dials the proxy (the daemon's
	// own connections, held to the proxy's bound on all connections, not
	// to the loopback address's: every tenant's sessions come from it).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Verify checks a key at sign-in; an error wrapping ErrBadKey is a
	// wrong key.
	Verify func(key string) (Identity, error)
	// Templates lists the template store (nil: the page says so).
	Templates func() ([]Template, error)
	// Host describes the host (walls, pools, capacity) for admin keys
	// (nil: the page says so).
	Host func(ctx context.Context) (any, error)
	// SessionIdle and SessionMax end a session after that long unused,
	// and that long after sign-in (defaults 30 minutes and 12 hours).
	SessionIdle, SessionMax time.Duration
	// MaxUpload bounds one uploaded file (default 100 MiB).
	MaxUpload int64
	// Record, when set, is told of each sign-in (a wrong key's too, with
	// no identity) and sign-out: the audit trail.
	Record func(r *http.Request, who Identity, status int)
	Log    *slog.Logger
}

// Template is one template of the store, as the templates page shows it.
type Template struct {
	Name    string    `json:"name"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	Source  string    `json:"source,omitempty"`
	Size    int64     `json:"size"`
	Layers  []Layer   `json:"layers"`
	Command string    `json:"startCommand,omitempty"`
}

// Layer is one layer of a template.
type Layer struct {
	ID    string `json:"id"`
	Size  int64  `json:"size"`
	Label string `json:"label,omitempty"`
}

// Defaults.
const (
	DefaultSessionIdle = 30 * time.Minute
	DefaultSessionMax  = 12 * time.Hour
	DefaultMaxUpload   = 100 << 20
)

// Server is the dashboard.
type Server struct {
	cfg      Config
	log      *slog.Logger
	sessions *sessions
	terms    *terminals
	mux      *http.ServeMux
	static   http.Handler
	now      func() time.Time
	// done ends every stream when the daemon shuts down (Shutdown).
	done     chan struct{}
	stopOnce sync.Once
}

// Shutdown ends the event streams and terminals, so that the server's
// own Shutdown does not wait on them (http.Server.RegisterOnShutdown).
func (s *Server) Shutdown() { s.stopOnce.Do(func() { close(s.done) }) }

// streamContext is r's context, also ended at Shutdown and when r's
// session ends or its key is revoked.
func (s *Server) streamContext(r *http.Request) (context.Context, context.CancelFunc) {
	ctx, cancelCause := context.WithCancelCause(r.Context())
	cancel := func() { cancelCause(nil) }
	ss := sessionOf(r)
	go func() {
		t := time.NewTicker(keyRecheck)
		defer t.Stop()
		for {
			select {
			case <-s.done:
				cancel()
				return
			case <-ctx.Done():
				return
			case <-t.C:
				// A session that ended or whose key was revoked ends
				// its streams and terminals too.
				if ss != nil && (!s.alive(r) || !s.keyValid(ss)) {
					cancelCause(errSessionEnded)
					return
				}
			}
		}
	}()
	return ctx, cancel
}

// errSessionEnded is why a stream's context ends when its session did
// (expired, signed out, its key revoked).
var errSessionEnded = errors.New("session ended")

// sessionEnded tells the page, when ctx ended with its session, to sign
// in again, and reports whether it did: a stream ended by the session
// check must say so, or the browser reconnects, is refused (401, which an
// event source does not show the page) and the page waits for nothing.
func sessionEnded(ctx context.Context, ev *sse) bool {
	if !errors.Is(context.Cause(ctx), errSessionEnded) {
		return false
	}
	_ = ev.send("expired", errorJSON{Code: http.StatusUnauthorized, Message: "session expired: sign in again"})
	return true
}

// New returns the dashboard; mount it at /ui/ (Mount).
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.SessionIdle <= 0 {
		cfg.SessionIdle = DefaultSessionIdle
	}
	if cfg.SessionMax <= 0 {
		cfg.SessionMax = DefaultSessionMax
	}
	if cfg.MaxUpload <= 0 {
		cfg.MaxUpload = DefaultMaxUpload
	}
	sub, _ := fs.Sub(staticFS, "static")
	s := &Server{cfg: cfg, log: cfg.Log, now: time.Now, terms: newTerminals(), done: make(chan struct{}),
		static: http.StripPrefix("/ui/static/", http.FileServerFS(sub))}
	s.sessions = newSessions(cfg.SessionIdle, cfg.SessionMax, func() time.Time { return s.now() })
	s.routes()
	return s
}

// Mount serves the dashboard at /ui beside next (the API).
func Mount(next http.Handler, s *Server) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/ui", s)
	mux.Handle("/ui/", s)
	mux.Handle("/", next)
	return mux
}

func (s *Server) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /ui", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/ui/", http.StatusFound)
	})
	m.HandleFunc("GET /ui/{$}", s.index)
	m.HandleFunc("GET /ui/static/", s.asset)
	m.HandleFunc("GET /ui/session", s.whoami)
	m.HandleFunc("POST /ui/session", s.signIn)
	m.Handle("DELETE /ui/session", s.authed(s.signOut))
	m.Handle("/ui/api/", s.authed(s.apiPass))
	m.Handle("GET /ui/events/sandboxes", s.authed(s.listEvents))
	m.Handle("GET /ui/events/sandboxes/{id}", s.authed(s.sandboxEvents))
	m.Handle("GET /ui/templates", s.authed(s.templates))
	m.Handle("GET /ui/events/builds/{id}", s.authed(s.buildEvents))
	m.Handle("GET /ui/host", s.authed(s.host))
	m.Handle("GET /ui/term/{id}", s.authed(s.termStream))
	m.Handle("POST /ui/term/{id}/{term}/input", s.authed(s.termInput))
	m.Handle("POST /ui/term/{id}/{term}/resize", s.authed(s.termResize))
	m.Handle("GET /ui/files/{id}/list", s.authed(s.fileList))
	m.Handle("GET /ui/files/{id}/download", s.authed(s.fileDownload))
	m.Handle("POST /ui/files/{id}/upload", s.authed(s.fileUpload))
	m.HandleFunc("/ui/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no such page: "+r.Method+" "+r.URL.Path)
	})
	s.mux = m
}

// ServeHTTP sets the headers every answer carries, then routes.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", csp)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	s.mux.ServeHTTP(w, r)
}

// csp allows this origin's scripts only (no inline script, no eval); styles
// may also be inline because xterm.js writes its theme into a <style>
// element it makes.
const csp = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; " +
	"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; object-src 'none'"

func (s *Server) index(w http.ResponseWriter, r *http.Request) {
	b, err := staticFS.ReadFile("static/index.html")
	if err != nil {
		writeError(w, http.StatusInternalServerError, "index missing from the binary")
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write(b)
}

func (s *Server) asset(w http.ResponseWriter, r *http.Request) {
	if strings.HasSuffix(r.URL.Path, "/") {
		writeError(w, http.StatusNotFound, "no such asset")
		return
	}
	w.Header().Set("Cache-Control", "private, max-age=300")
	s.static.ServeHTTP(w, r)
}
