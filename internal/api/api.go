// Package api is the daemon's control API: E2B's REST API (so the E2B SDKs
// work unchanged) with cage's own fields added. The document is
// api/openapi.yaml, and the bodies are its types generated in api/types.
// Errors are E2B's JSON {code, message}; kinds of errors become statuses
// only here, and sizes are MiB only here (memoryMB, diskSizeMB): the
// manager and everything behind it count bytes.
package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/metrics"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// EnvdVersion is the envd version cage reports for its agent.
const EnvdVersion = "0.6.13"

// maxBody bounds request bodies.
const maxBody = 1 << 20

// Config configures the API.
type Config struct {
	Manager *manager.Manager
	Store   *store.Store
	Log     *slog.Logger
	Domain  string // for E2B's {port}-{id}.{domain} hosts; "" leaves it null
	// DefaultWall is the wall of a create that names none.
	DefaultWall string
	// V1Timeout and V2Timeout are the defaults when a create names none
	// (E2B: 15 s for POST /sandboxes, 300 s for POST /v2/sandboxes).
	V1Timeout, V2Timeout time.Duration
	// Audit is the audit trail (nil: none): every call is recorded, and
	// GET /audit serves a key's entries.
	Audit *audit.Trail
	// Metrics counts calls, refusals by rate and quota (nil: none).
	Metrics *metrics.Metrics
	// Rates are each key's rate limits unless its team sets its own
	// (zero fields: none).
	Rates Rates
	// Build builds templates for admin keys (builds.go; nil: 503).
	Build BuildFunc
	// Cluster is the cluster front in cluster mode (cluster.go; nil: one
	// host).
	Cluster Cluster
}

type server struct {
	cfg    Config
	log    *slog.Logger
	limits limiter
	builds builds
	lists  inFlight // each owner's list requests in flight (listing)
	// contentLists: listings of each owner's volumes in flight (listDir).
	contentLists inFlight
}

// Server is the API's HTTP handler. Its AllowRequest is the key's
// request rate for the daemon's other doors that take API keys (/mcp).
type Server struct {
	http.Handler
	s *server
}

// AllowRequest takes one of key k's request tokens, as every API request
// does, or answers 429 with Retry-After and returns false.
func (h *Server) AllowRequest(w http.ResponseWriter, k *store.APIKey) bool {
	return h.s.allowRequest(w, k)
}

// Handler returns the API's HTTP handler.
func Handler(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.V1Timeout == 0 {
		cfg.V1Timeout = 15 * time.Second
	}
	if cfg.V2Timeout == 0 {
		cfg.V2Timeout = 300 * time.Second
	}
	s := &server{cfg: cfg, log: cfg.Log}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, types.Health{Status: types.HealthStatusOk})
	})
	auth := s.authenticated
	mux.Handle("POST /sandboxes", auth(s.create(false)))
	mux.Handle("POST /v2/sandboxes", auth(s.create(true)))
	mux.Handle("GET /sandboxes", auth(s.listing(s.listV1)))
	mux.Handle("GET /v2/sandboxes", auth(s.listing(s.listV2)))
	mux.Handle("GET /sandboxes/{sandboxID}", auth(s.routed(http.HandlerFunc(s.get))))
	mux.Handle("DELETE /sandboxes/{sandboxID}", auth(s.routed(http.HandlerFunc(s.kill))))
	mux.Handle("POST /sandboxes/{sandboxID}/timeout", auth(s.routed(http.HandlerFunc(s.timeout))))
	mux.Handle("POST /sandboxes/{sandboxID}/refreshes", auth(s.routed(http.HandlerFunc(s.refresh))))
	mux.Handle("POST /sandboxes/{sandboxID}/pause", auth(s.routed(http.HandlerFunc(s.pause))))
	mux.Handle("POST /sandboxes/{sandboxID}/resume", auth(s.routed(http.HandlerFunc(s.resume))))
	mux.Handle("POST /sandboxes/{sandboxID}/snapshots", auth(s.routed(http.HandlerFunc(s.createSnapshot))))
	mux.Handle("POST /sandboxes/{sandboxID}/fork", auth(s.routed(http.HandlerFunc(s.fork))))
	mux.Handle("GET /snapshots", auth(http.HandlerFunc(s.listSnapshots)))
	mux.Handle("DELETE /templates/{templateID}", auth(http.HandlerFunc(s.deleteTemplate)))
	mux.Handle("POST /sandboxes/{sandboxID}/connect", auth(s.routed(s.connect(false))))
	mux.Handle("POST /v2/sandboxes/{sandboxID}/connect", auth(s.routed(s.connect(true))))
	mux.Handle("GET /sandboxes/{sandboxID}/metrics", auth(s.routed(http.HandlerFunc(s.metrics))))
	mux.Handle("PUT /sandboxes/{sandboxID}/network", auth(s.routed(http.HandlerFunc(s.updateNetwork))))
	mux.Handle("GET /sandboxes/{sandboxID}/network/records", auth(s.routed(s.listing(s.networkRecords))))
	mux.Handle("GET /audit", auth(s.listing(s.auditEntries)))
	s.volumeRoutes(mux)
	s.adminRoutes(mux)
	s.buildRoutes(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no such route: "+r.Method+" "+r.URL.Path)
	})
	return &Server{Handler: recoverer(s.log, s.audited(mux)), s: s}
}

type ctxKey struct{}

// authenticated checks X-API-Key, then the key's request rate, and puts
// the key in the context.
func (s *server) authenticated(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-API-Key")
		if key == "" {
			writeError(w, http.StatusUnauthorized, "missing API key: send it in the X-API-Key header")
			return
		}
		k, err := s.cfg.Store.VerifyKey(key)
		if err != nil {
			if !errors.Is(err, store.ErrNotFound) {
				s.fail(w, r, err)
				return
			}
			writeError(w, http.StatusUnauthorized, "invalid API key")
			return
		}
		noteKey(r, k.ID, k.TeamID)
		if !s.forwarded(r) && !s.allowRequest(w, k) {
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, k)))
	})
}

// keyID is the owner of what the calling key makes and sees: its team,
// or the key itself when it has none (store.APIKey.Owner).
func keyID(r *http.Request) string {
	if k := callerOf(r); k != nil {
		return k.Owner()
	}
	return ""
}

// callerOf is the calling key (nil before authenticated).
func callerOf(r *http.Request) *store.APIKey {
	k, _ := r.Context().Value(ctxKey{}).(*store.APIKey)
	return k
}

// recoverer turns a panic into a 500 without a stack trace for the client.
func recoverer(log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				log.Error("panic in handler", "route", r.Method+" "+r.URL.Path, "panic", fmt.Sprint(v))
				writeError(w, http.StatusInternalServerError, "internal error")
			}
		}()
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// listWriter writes a JSON array a value at a time (200), as writeJSON
// would write it whole: a list's answer is never held whole in memory,
// only the value being written. head is what comes before the first
// value ("[" when empty); end writes what comes after the last.
type listWriter struct {
	w       http.ResponseWriter
	head    string
	started bool
}

// add writes one value of the array.
func (l *listWriter) add(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		// The API's own types marshal; were one not to, the answer is
		// cut short rather than sent as if whole.
		panic(http.ErrAbortHandler)
	}
	l.open(true)
	_, _ = l.w.Write(b)
}

// open writes the answer's head before the first value, a comma before
// any other (sep).
func (l *listWriter) open(sep bool) {
	if l.started {
		if sep {
			_, _ = l.w.Write([]byte{','})
		}
		return
	}
	l.started = true
	if l.head == "" {
		l.head = "["
	}
	l.w.Header().Set("Content-Type", "application/json")
	l.w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(l.w, l.head)
}

// end closes the array with tail ("]\n" when empty), the head first when
// nothing was added.
func (l *listWriter) end(tail string) {
	l.open(false)
	if tail == "" {
		tail = "]\n"
	}
	_, _ = io.WriteString(l.w, tail)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, types.Error{Code: int32(status), Message: msg})
}

// fail maps an error kind to its status.
func (s *server) fail(w http.ResponseWriter, r *http.Request, err error) {
	code, msg := s.failure(r, err)
	if code == http.StatusTooManyRequests && !errors.Is(err, manager.ErrQuota) {
		w.Header().Set("Retry-After", "1")
	}
	writeError(w, code, msg)
}

// failure is the status and one-line message a client gets for err.
func (s *server) failure(r *http.Request, err error) (int, string) {
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return http.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than %d bytes", maxBody)
	case errors.Is(err, manager.ErrNotFound), errors.Is(err, sandbox.ErrNotFound):
		return http.StatusNotFound, err.Error()
	case errors.Is(err, sandbox.ErrInvalid), errors.Is(err, errBadRequest), errors.Is(err, imgstore.ErrInvalid):
		return http.StatusBadRequest, err.Error()
	case errors.Is(err, manager.ErrConflict):
		return http.StatusConflict, err.Error()
	case errors.Is(err, manager.ErrLimit):
		return http.StatusTooManyRequests, err.Error()
	case errors.Is(err, manager.ErrQuota):
		s.cfg.Metrics.QuotaRefused(quotaName(err))
		return http.StatusTooManyRequests, err.Error()
	case errors.Is(err, errForbidden):
		return http.StatusForbidden, err.Error()
	case errors.Is(err, sandbox.ErrUnavailable), errors.Is(err, sandbox.ErrPermission):
		return http.StatusServiceUnavailable, s.unavailable(r, err)
	}
	// The detail (host paths, SQL) is the operator's, in the log; the
	// client gets an id to quote.
	id := requestID()
	s.log.Error("request failed", "route", r.Method+" "+r.URL.Path, "request", id, "err", logged(err))
	return http.StatusInternalServerError, "internal error (request " + id + "; the server's log has the detail)"
}

// unavailable is what a client is told of a host that cannot do what it
// asked: the message up to the clause that names a host path, the rest in
// the log under a request id the client gets.
func (s *server) unavailable(r *http.Request, err error) string {
	msg, cut := WithoutHostPaths(err.Error())
	if cut {
		id := requestID()
		s.log.Error("request failed", "route", r.Method+" "+r.URL.Path, "request", id, "err", logged(err))
		msg += " (request " + id + "; the server's log has the detail)"
	}
	return msg
}

// logged is an error's text for the log, bounded: it may quote what the
// client sent.
func logged(err error) string {
	msg := err.Error()
	if len(msg) > maxLoggedError {
		msg = msg[:maxLoggedError] + "…(cut)"
	}
	return msg
}

// WithoutHostPaths is what a client is told of a host's unavailability:
// the message up to the clause that names a path on the host (the
// operator's: the daemon's data and run directories, cgroups, a guest
// kernel's directory, with the free space there), and whether it was cut.
// A tenant asking for a wall the host lacks, or pausing when the disk is
// low, read them (found by review, 2026-12-03).
func WithoutHostPaths(msg string) (string, bool) {
	at := -1
	for i := 0; i < len(msg); i++ {
		if msg[i] != '/' {
			continue
		}
		if i == 0 || !(isWordByte(msg[i-1])) {
			at = i
			break
		}
	}
	if at < 0 {
		return msg, false
	}
	end := max(strings.LastIndex(msg[:at], ": "), strings.LastIndex(msg[:at], " ("))
	if end < 0 {
		return "unavailable on this host", true
	}
	return msg[:end], true
}

// isWordByte says whether c may come before a '/' that is not a path's
// root (scripts/kernel.sh, 0/3).
func isWordByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_'
}

var errBadRequest = errors.New("bad request")

// maxLoggedError bounds the error a failed request logs.
const maxLoggedError = 4 << 10

// requestID names one failed request in the log and in its answer.
// RequestID is a new id for a failure whose detail goes to the log only,
// for the client to quote.
func RequestID() string { return requestID() }

func requestID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// decode reads a JSON body into v; an empty body leaves v as it is when
// optional.
func decode(r *http.Request, v any, optional bool) error {
	dec := json.NewDecoder(r.Body)
	err := dec.Decode(v)
	var tooBig *http.MaxBytesError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &tooBig):
		return err
	case optional && err.Error() == "EOF":
		return nil
	}
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) {
		// Told in the API's words: Go's message names this program's
		// types ("Go struct field NewSandbox.cpuCount of type float64").
		where := "the body"
		if typeErr.Field != "" {
			where = "field " + typeErr.Field
		}
		return fmt.Errorf("%w: malformed JSON body: %s: want %s, got %s", errBadRequest, where, jsonKind(typeErr.Type), typeErr.Value)
	}
	return fmt.Errorf("%w: malformed JSON body: %v", errBadRequest, err)
}

// jsonKind names what JSON value a Go type decodes from.
func jsonKind(t reflect.Type) string {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return "another value"
	}
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	}
	return "another value"
}

func seconds(n *int64, def time.Duration) (time.Duration, error) {
	if n == nil {
		return def, nil
	}
	if *n <= 0 {
		return 0, fmt.Errorf("%w: timeout must be at least 1 second", errBadRequest)
	}
	if *n > int64(math.MaxInt64/time.Second) {
		// Saturate rather than wrap: the manager names its maximum.
		return time.Duration(math.MaxInt64), nil
	}
	return time.Duration(*n) * time.Second, nil
}

func atoiDefault(s string, def int) (int, error) {
	if s == "" {
		return def, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, fmt.Errorf("%w: %q is not a number", errBadRequest, s)
	}
	return n, nil
}
