package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
)

// The audit trail's side of the API: every call is recorded once it is
// answered (route, key, sandbox, status, client address; GET /health
// aside), and GET /audit serves a key's entries.

// callInfo is what the handlers learn of a call for its entry: the key
// that made it and its team (or, on the volume content API, the volume's
// owner).
type callInfo struct{ key, team string }

type callInfoKey struct{}

func noteKey(r *http.Request, key, team string) {
	if info, _ := r.Context().Value(callInfoKey{}).(*callInfo); info != nil {
		info.key, info.team = key, team
	}
}

// statusWriter remembers the status a handler answered.
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

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// audited records each call the mux answers in the trail, and counts it
// in the metrics.
func (s *server) audited(mux http.Handler) http.Handler {
	if s.cfg.Audit == nil && s.cfg.Metrics == nil {
		return mux
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			mux.ServeHTTP(w, r)
			return
		}
		info := &callInfo{}
		r = r.WithContext(context.WithValue(r.Context(), callInfoKey{}, info))
		sw := &statusWriter{ResponseWriter: w}
		finished := false
		start := time.Now()
		defer func() {
			status := sw.status
			if status == 0 {
				status = http.StatusOK
				if !finished {
					status = http.StatusInternalServerError // a panic (recoverer answers)
				}
			}
			if s.cfg.Metrics != nil {
				s.cfg.Metrics.APICall(metricRoute(r), status, time.Since(start))
			}
			if s.cfg.Audit != nil && !(r.Context().Value(quietKey{}) != nil && r.Method == http.MethodGet) {
				s.recordCall(r, info, status)
			}
		}()
		mux.ServeHTTP(sw, r)
		finished = true
	})
}

type quietKey struct{}

// Quiet marks a request as the dashboard's own read (internal/ui, in this
// process: its live pages' polls every few seconds, and the lookup of a
// sandbox's token before it asks the agent, which the proxy records): a
// GET so marked is answered, rate-limited and counted as any other but not
// written to the audit trail, where the polls would crowd out what the key
// did. Only this process can set it; no request from outside carries it.
func Quiet(ctx context.Context) context.Context { return context.WithValue(ctx, quietKey{}, true) }

// metricRoute is a call's route as a metric's label: the mux's pattern,
// a bounded set ("" for none).
func metricRoute(r *http.Request) string {
	if r.Pattern == "/" || r.Pattern == "/volumecontent/" {
		return ""
	}
	return r.Pattern
}

// recordCall records one answered call; r is the request the mux routed.
func (s *server) recordCall(r *http.Request, info *callInfo, status int) {
	route := r.Pattern
	if route == "" || route == "/" || route == "/volumecontent/" {
		route = r.Method + " (no such route)"
	}
	var detail map[string]any
	if v := r.PathValue("volumeID"); v != "" {
		detail = map[string]any{"volume": v}
	}
	client := r.RemoteAddr
	if h, _, err := net.SplitHostPort(client); err == nil {
		client = h
	}
	s.cfg.Audit.Record(audit.Event{Kind: audit.KindAPICall, KeyID: info.key, TeamID: info.team, SandboxID: r.PathValue("sandboxID"),
		Route: route, Status: status, Client: client, Detail: detail})
}

const (
	defaultAuditPage = 100
	maxAuditPage     = 1000
	// maxAuditKinds bounds a query's distinct kinds and families (there
	// are some 40 kinds in 11 families): each is a term of the statement
	// compiled for the request, and 900 cost 49 ms of the daemon's CPU,
	// past 1,000 a 500 (SQLite's expression depth); found by review,
	// 2026-12-04.
	maxAuditKinds = 16
)

// auditEntries is GET /audit: a page of the key's entries, oldest first.
func (s *server) auditEntries(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Audit == nil {
		s.fail(w, r, fmt.Errorf("%w: this server keeps no audit trail", errBadRequest))
		return
	}
	f, err := auditFilter(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	// The page is first its entries' seqs; the entries are then read and
	// written a few at a time. Read and encoded whole, a page of 1,000
	// entries of 16 KiB of argv each (a tenant's own process starts,
	// control characters six bytes as JSON) held 172 MiB of the daemon
	// per request (found by review, 2026-12-04).
	limit := f.Limit
	f.Limit++
	s.cfg.Audit.Flush() // what happened up to this call
	seqs, err := s.cfg.Audit.DB().Seqs(f)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	next := ""
	if len(seqs) > limit {
		seqs = seqs[:limit]
		next = strconv.FormatInt(seqs[limit-1], 10)
	}
	var dropped int64
	if f.SandboxID != "" {
		key, _, d, err := s.cfg.Audit.DB().Counts(f.SandboxID)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		if key == keyID(r) { // the sandbox's owner (its team, or the key)
			dropped = d
		}
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	// types.AuditPage's fields, in its order: dropped, entries, nextToken.
	lw := listWriter{w: w, head: `{"entries":[`}
	if dropped != 0 {
		lw.head = `{"dropped":` + strconv.FormatInt(dropped, 10) + `,"entries":[`
	}
	tail := "]}\n"
	if next != "" {
		tail = `],"nextToken":"` + next + "\"}\n"
	}
	for len(seqs) > 0 {
		chunk := seqs[:min(len(seqs), auditChunk)]
		seqs = seqs[len(chunk):]
		es, err := s.cfg.Audit.DB().Entries(chunk)
		if err != nil {
			if !lw.started {
				s.fail(w, r, err)
				return
			}
			s.log.Error("audit entries: a later chunk failed", "err", logged(err))
			panic(http.ErrAbortHandler)
		}
		for _, e := range es {
			lw.add(EntryJSON(e))
		}
	}
	lw.end(tail)
}

// auditChunk is how many entries of a page are read at a time.
const auditChunk = 32

// auditFilter reads GET /audit's query for the calling key: its team's
// entries, or its own when it has no team.
func auditFilter(r *http.Request) (audit.Filter, error) {
	q := r.URL.Query()
	f := audit.Filter{SandboxID: q.Get("sandboxID")}
	f.KeyID, f.TeamID = audit.SplitOwner(keyID(r))
	var err error
	if f.Limit, err = atoiDefault(q.Get("limit"), defaultAuditPage); err != nil || f.Limit < 1 || f.Limit > maxAuditPage {
		return f, fmt.Errorf("%w: limit must be 1 to %d entries", errBadRequest, maxAuditPage)
	}
	if v := q.Get("kind"); v != "" {
		for _, k := range strings.Split(v, ",") {
			if k = strings.TrimSpace(k); !audit.ValidKind(k) {
				return f, fmt.Errorf("%w: kind %q: want a kind (process.start) or a family (process)", errBadRequest, k)
			}
			if !slices.Contains(f.Kinds, k) {
				f.Kinds = append(f.Kinds, k)
			}
			if len(f.Kinds) > maxAuditKinds {
				return f, fmt.Errorf("%w: kind: at most %d kinds and families", errBadRequest, maxAuditKinds)
			}
		}
	}
	for _, t := range []struct {
		name string
		dst  *time.Time
	}{{"since", &f.Since}, {"until", &f.Until}} {
		if v := q.Get(t.name); v != "" {
			if *t.dst, err = time.Parse(time.RFC3339Nano, v); err != nil {
				return f, fmt.Errorf("%w: %s %q: want an RFC 3339 time", errBadRequest, t.name, v)
			}
		}
	}
	if v := q.Get("nextToken"); v != "" {
		if f.After, err = strconv.ParseInt(v, 10, 64); err != nil || f.After < 1 {
			return f, fmt.Errorf("%w: nextToken %q is not one this server gave", errBadRequest, v)
		}
	}
	return f, nil
}

// EntryJSON is an entry as the API shows it.
func EntryJSON(e audit.Entry) types.AuditEntry {
	out := types.AuditEntry{Seq: e.Seq, Time: e.Time, Kind: e.Kind, Source: types.AuditEntrySource(e.Source), KeyID: e.KeyID,
		TeamID: e.TeamID, SandboxID: e.SandboxID, Route: e.Route, Status: e.Status, Client: e.Client, Prev: e.Prev, Hash: e.Hash}
	if e.Detail != "" && e.Detail != "{}" {
		_ = json.Unmarshal([]byte(e.Detail), &out.Detail)
	}
	return out
}
