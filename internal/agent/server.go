// Package agent is cage-agent's server: the one program that runs commands and
// touches files inside every sandbox, whatever its wall. It speaks E2B's envd
// protocol: Connect RPC services process.Process and filesystem.Filesystem
// (JSON and binary codecs, HTTP/1.1 and h2c), plus plain HTTP /health, /envs
// and /files.
//
// The agent is assumed hostile by the host: nothing it reports is used to
// enforce a limit. Inside the sandbox it is the only holder of privilege, so
// it guards itself: every request but /health must carry the sandbox's access
// token (or, for /files, a signature made with it), checked before the body
// is read, and bodies are bounded (auth.go); every file operation acts with
// the requesting user's credentials, never the agent's (creds.go).
package agent

import (
	"context"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// Version is the envd protocol version the agent reports. E2B SDKs gate
// features on it and refuse sandboxes below 0.1.0.
const Version = "0.6.13"

// DefaultMaxOutput caps the output forwarded for one process when the request
// sets no cap of its own: enough for any sane build log, small enough that a
// flood cannot exhaust the host.
const DefaultMaxOutput = 64 << 20

// Config is what the agent needs to serve one sandbox.
type Config struct {
	// Token is the sandbox's access token; empty disables the check (tests).
	Token string
	// DefaultUser runs commands and owns files when a request names no user.
	DefaultUser string
	// Env is the sandbox-wide environment: given to every process, served at /envs.
	Env map[string]string
	// Root is the directory file paths resolve in: "/" inside a sandbox, a
	// temporary directory in tests. Paths never resolve outside it.
	Root string
	// Passwd and Group are the sandbox's account files.
	Passwd, Group string
	// MaxOutput caps each process's forwarded output (0: DefaultMaxOutput).
	MaxOutput int64
	// MaxInflatedUpload caps what one gzip-encoded upload may decompress
	// to (0: DefaultMaxInflatedUpload).
	MaxInflatedUpload int64
	// SpawnThreadSetup, when set, runs once on the OS thread that forks every
	// process, before the first fork (see spawner).
	SpawnThreadSetup func() error
	// Threads, when set, is how many OS threads the agent takes before it
	// serves (see reserveThreads).
	Threads int
	// AgentUID, when not 0, is the agent's own uid inside the sandbox, which
	// no request may act as.
	AgentUID int
	// Limits, when set, tells why a process was killed (OOM, pids limit).
	Limits LimitEvents
	// Volumes are where volumes are mounted: their files are the volume's,
	// kept by the host, never archived with the sandbox's (archive.go).
	Volumes []string
	// OneShot: the agent runs one command (RunOnce) and serves nothing
	// over HTTP (sudo only), so New makes no handlers.
	OneShot bool
	Log     *slog.Logger
}

// LimitEvents reads counters that the host's cgroups keep for the sandbox.
// Each returns the number of times the limit was hit so far.
type LimitEvents interface {
	OOMKills() uint64
	PidsMax() uint64
}

// Server serves one sandbox.
type Server struct {
	cfg   Config
	log   *slog.Logger
	procs *processService
	files *filesystemService
	mux   *http.ServeMux

	mu       sync.Mutex
	srv      *http.Server
	openGate sync.Once
	fileWork chan struct{} // a slot per file operation in progress
	// configured is when the sandbox was started (Configure): files of its
	// image changed since are its own (see archive.go).
	configured time.Time
	// rootUpper is where the root overlay's upper layer can be read, when
	// the agent can (ArchiveRootFrom); empty otherwise. rootLayer is the
	// open directory that path goes through, held here so that it stays
	// open.
	rootUpper string
	rootLayer *os.File
}

// heapTarget is the agent's soft heap limit: far above an idle agent's few
// MiB, a few of its largest requests (16 MiB each).
const heapTarget = 48 << 20

// fileWorkers bounds the file operations in progress (see asUser). Each
// holds a locked OS thread, and may block it in a system call, and the
// agent's threads are a fixed budget (a workload can take every other pid
// of the sandbox), so requests beyond this wait their turn rather than make
// the runtime start threads.
const fileWorkers = 4

// New builds the agent's server.
func New(cfg Config) (*Server, error) {
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = "user"
	}
	if cfg.Root == "" {
		cfg.Root = "/"
	}
	if cfg.Passwd == "" {
		cfg.Passwd = "/etc/passwd"
	}
	if cfg.Group == "" {
		cfg.Group = "/etc/group"
	}
	if cfg.MaxOutput <= 0 {
		cfg.MaxOutput = DefaultMaxOutput
	}
	if cfg.MaxInflatedUpload <= 0 {
		cfg.MaxInflatedUpload = DefaultMaxInflatedUpload
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if os.Getenv("GOMEMLIMIT") == "" {
		// The agent lives in the sandbox's memory: past a few tens of MiB
		// of heap (a burst of large requests), collect at once rather
		// than let the heap double first.
		debug.SetMemoryLimit(heapTarget)
	}
	s := &Server{cfg: cfg, log: cfg.Log, fileWork: make(chan struct{}, fileWorkers), configured: time.Now()}
	var err error
	trace("agent: new")
	if s.procs, err = newProcessService(s); err != nil {
		return nil, err
	}
	trace("agent: process service")
	s.files = newFilesystemService(s)
	if cfg.OneShot {
		s.mux = http.NewServeMux() // serves nothing
		if cfg.Threads <= 0 || !s.procs.init {
			s.openGate.Do(func() { close(s.procs.spawner.gate) })
		}
		return s, nil
	}

	mux := http.NewServeMux()
	// route (auth.go) checks the token before any handler runs; the
	// interceptor checks it a second time.
	auth := connect.WithInterceptors(s.authInterceptor())
	path, h := processconnect.NewProcessHandler(s.procs, append(rpcOptions(maxProcessMessage), auth)...)
	mux.Handle(path, h)
	path, h = filesystemconnect.NewFilesystemHandler(s.files, append(rpcOptions(maxFilesystemMessage), auth)...)
	mux.Handle(path, h)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})
	mux.Handle("GET /envs", s.requireToken(http.HandlerFunc(s.serveEnvs)))
	mux.HandleFunc("GET /files", s.files.serveFiles)
	mux.HandleFunc("POST /files", s.files.serveFiles)
	mux.Handle("GET /cage/archive", s.requireToken(http.HandlerFunc(s.serveArchive)))
	mux.Handle("POST /cage/restore", s.requireToken(http.HandlerFunc(s.serveRestore)))
	mux.Handle("POST /cage/kill", s.requireToken(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.signalAll(syscall.SIGKILL)
		w.WriteHeader(http.StatusNoContent)
	})))
	s.mux = mux
	trace("agent: handlers")
	if cfg.Threads <= 0 || !s.procs.init {
		s.openGate.Do(func() { close(s.procs.spawner.gate) })
	}
	return s, nil
}

// Configure sets what is particular to one sandbox's request: the access
// token, the sandbox-wide environment and the output cap. It must come before
// Serve (a pool builds the agent before the sandbox is asked for).
func (s *Server) Configure(token string, env map[string]string, maxOutput int64) {
	s.configured = time.Now()
	s.cfg.Token, s.cfg.Env = token, env
	if maxOutput > 0 {
		s.cfg.MaxOutput = maxOutput
	}
}

// ArchiveRootFrom tells the agent where the root overlay's upper layer can
// be read: the directory name under layer, a directory its init opened
// before the root changed (the microvm guest's tmpfs). An archive of the
// root walks it, where the sandbox's changes are, instead of the whole
// image. It returns the layer's path, /proc/self/fd/N/name. The server
// keeps layer open for its life: the path goes through its descriptor,
// which the *os.File's finalizer would close once nothing else held it
// (the guest's did, under load: a garbage collection in the middle of a
// pause's archive closed it, and every file the walk had not yet reached
// was left out without a word, found 2026-12-05). Call it before Serve.
func (s *Server) ArchiveRootFrom(layer *os.File, name string) string {
	s.rootLayer = layer
	s.rootUpper = "/proc/self/fd/" + strconv.Itoa(int(layer.Fd())) + "/" + name
	return s.rootUpper
}

// Handler returns the agent's HTTP handler.
func (s *Server) Handler() http.Handler { return http.HandlerFunc(s.route) }

// Serve accepts connections on l until Shutdown. It speaks HTTP/1.1 and
// HTTP/2 without TLS (client-streaming RPCs need HTTP/2).
//
// Serve first opens the spawner's gate: at once, or, when Config.Threads is
// set, once the agent holds its threads (taken after the caller has sealed
// the process, so that sealing, which touches every thread, has few to
// touch). Requests are accepted meanwhile; forks wait.
func (s *Server) Serve(l net.Listener) error {
	s.startSudo()
	s.ReserveThreads()
	err := s.httpServer().Serve(l)
	if err == http.ErrServerClosed {
		return nil
	}
	return err
}

// httpServer is the agent's HTTP server: HTTP/1.1 and h2c, every request
// through route. It is made once: WarmUp's request and Serve's share it,
// so that its own set-up at first use is behind WarmUp too.
func (s *Server) httpServer() *http.Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil {
		var p http.Protocols
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		s.srv = &http.Server{Handler: http.HandlerFunc(s.route), Protocols: &p, ReadHeaderTimeout: 30 * time.Second,
			IdleTimeout: 5 * time.Minute, MaxHeaderBytes: 64 << 10}
	}
	return s.srv
}

// ReserveThreads starts taking the agent's threads (Config.Threads) in the
// background, once: forks wait until it has them. Serve calls it; a caller
// that seals the process first may call it earlier, so that a sandbox kept
// in a pool has its threads before its request.
func (s *Server) ReserveThreads() {
	s.openGate.Do(func() {
		go func() {
			reserveThreads(s.cfg.Threads)
			close(s.procs.spawner.gate)
		}()
	})
}

// Shutdown stops serving and kills every process the agent started.
func (s *Server) Shutdown(ctx context.Context) error {
	s.procs.killAll()
	s.files.closeWatchers()
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	if srv == nil {
		return nil
	}
	return srv.Shutdown(ctx)
}

func (s *Server) serveEnvs(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	env := s.cfg.Env
	if env == nil {
		env = map[string]string{}
	}
	_ = json.NewEncoder(w).Encode(env)
}

// tokenOK reports whether h carries the sandbox's access token.
func (s *Server) tokenOK(h http.Header) bool {
	if s.cfg.Token == "" {
		return true
	}
	got := h.Get("X-Access-Token")
	return subtle.ConstantTimeCompare([]byte(got), []byte(s.cfg.Token)) == 1
}

func (s *Server) requireToken(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.tokenOK(r.Header) {
			http.Error(w, "missing or invalid access token", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) authInterceptor() connect.Interceptor {
	return authInterceptor{s}
}

type authInterceptor struct{ s *Server }

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !a.s.tokenOK(req.Header()) {
			return nil, errUnauthenticated
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if !a.s.tokenOK(conn.RequestHeader()) {
			return errUnauthenticated
		}
		return next(ctx, conn)
	}
}

var errUnauthenticated = connect.NewError(connect.CodeUnauthenticated, errString("missing or invalid access token"))

type errString string

func (e errString) Error() string { return string(e) }

// requestUser returns the user a request acts as: the name in
// `Authorization: Basic base64("name:")`, else the default user.
func (s *Server) requestUser(h http.Header) (User, error) {
	name := s.cfg.DefaultUser
	if auth := h.Get("Authorization"); strings.HasPrefix(auth, "Basic ") {
		raw, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(auth, "Basic "))
		if err == nil {
			if n, _, _ := strings.Cut(string(raw), ":"); n != "" {
				name = n
			}
		}
	}
	return s.lookupUser(name)
}

func (s *Server) lookupUser(name string) (User, error) {
	u, err := LookupUser(s.cfg.Passwd, name)
	if err != nil {
		return User{}, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if s.cfg.AgentUID != 0 && (u.UID == s.cfg.AgentUID || u.GID == s.cfg.AgentUID) {
		// Nothing may run as the agent: its uid is what keeps the
		// sandbox's processes away from it.
		return User{}, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("user %q is reserved for the agent", name))
	}
	return u, nil
}
