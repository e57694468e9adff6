package api

import (
	"fmt"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

const clientID = "cage"

func (s *server) domain() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

// metadataOf is a record's metadata as the API shows it: never null.
func metadataOf(rec *store.Sandbox) types.SandboxMetadata {
	if rec.Metadata == nil {
		return types.SandboxMetadata{}
	}
	return rec.Metadata
}

// sandboxOf is a record as E2B's Sandbox (create and connect answers).
func (s *server) sandboxOf(rec *store.Sandbox) types.Sandbox {
	traffic := rec.TrafficToken
	return types.Sandbox{SandboxID: rec.ID, TemplateID: rec.TemplateID, ClientID: clientID,
		EnvdVersion: EnvdVersion, EnvdAccessToken: rec.AccessToken, TrafficAccessToken: &traffic,
		Domain: s.domain(), Wall: types.Wall(rec.Wall), CPUCount: rec.CPUs, MemoryMB: rec.Memory >> 20,
		DiskSizeMB: rec.Disk >> 20, Pids: rec.Pids, VolumeMounts: mountsOf(rec)}
}

// listedOf is a record as E2B's ListedSandbox.
func listedOf(rec *store.Sandbox) types.ListedSandbox {
	return types.ListedSandbox{SandboxID: rec.ID, TemplateID: rec.TemplateID, ClientID: clientID,
		StartedAt: rec.StartedAt.UTC(), EndAt: rec.EndAt.UTC(), CPUCount: rec.CPUs, MemoryMB: rec.Memory >> 20,
		DiskSizeMB: rec.Disk >> 20, Metadata: metadataOf(rec), State: types.SandboxState(rec.State),
		EnvdVersion: EnvdVersion, Wall: types.Wall(rec.Wall), Pids: rec.Pids, VolumeMounts: mountsOf(rec)}
}

// detailOf is a record as E2B's SandboxDetail: ListedSandbox's fields and
// what a client needs to reach it.
func (s *server) detailOf(rec *store.Sandbox) types.SandboxDetail {
	n, internet := networkOf(rec)
	traffic := rec.TrafficToken
	return types.SandboxDetail{SandboxID: rec.ID, TemplateID: rec.TemplateID, ClientID: clientID,
		StartedAt: rec.StartedAt.UTC(), EndAt: rec.EndAt.UTC(), CPUCount: rec.CPUs, MemoryMB: rec.Memory >> 20,
		DiskSizeMB: rec.Disk >> 20, Metadata: metadataOf(rec), State: types.SandboxState(rec.State),
		EnvdVersion: EnvdVersion, Wall: types.Wall(rec.Wall), Pids: rec.Pids,
		EnvdAccessToken: rec.AccessToken, TrafficAccessToken: &traffic, Domain: s.domain(), AllowInternetAccess: &internet, Network: n,
		Lifecycle: lifecycleOf(rec), PausedWith: types.SandboxDetailPausedWith(rec.PauseKind), VolumeMounts: mountsOf(rec)}
}

// lifecycleOf is E2B's lifecycle of a sandbox.
func lifecycleOf(rec *store.Sandbox) types.SandboxLifecycle {
	l := types.SandboxLifecycle{OnTimeout: types.SandboxLifecycleOnTimeoutKill, AutoResume: rec.AutoResume}
	if rec.AutoPause {
		l.OnTimeout = types.SandboxLifecycleOnTimeoutPause
	}
	return l
}

func (s *server) create(v2 bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.allowCreate(w, r) {
			return
		}
		// Both versions' bodies decode as v1's (NewSandboxV2 and secure).
		var body types.NewSandbox
		if err := decode(r, &body, false); err != nil {
			s.fail(w, r, err)
			return
		}
		req, err := s.createRequest(body, v2)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		req.KeyID = keyID(r)
		rec, err := s.createSandbox(r.Context(), req)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusCreated, s.sandboxOf(rec))
	})
}

// createRequest checks a create body and turns it into the manager's
// request (without the key).
func (s *server) createRequest(body types.NewSandbox, v2 bool) (manager.CreateRequest, error) {
	if body.TemplateID == "" {
		return manager.CreateRequest{}, fmt.Errorf("%w: templateID is required", errBadRequest)
	}
	wall := string(body.Wall)
	if wall == "" {
		wall = s.cfg.DefaultWall
	}
	def := s.cfg.V1Timeout
	if v2 {
		def = s.cfg.V2Timeout
	}
	timeout, err := seconds(body.Timeout, def)
	if err != nil {
		return manager.CreateRequest{}, err
	}
	for _, v := range []int64{body.MemoryMB, body.DiskSizeMB, body.Pids} {
		if v < 0 {
			return manager.CreateRequest{}, fmt.Errorf("%w: limits must be positive", errBadRequest)
		}
	}
	if !(body.CPUCount >= 0) || math.IsInf(body.CPUCount, 0) {
		return manager.CreateRequest{}, fmt.Errorf("%w: cpuCount must be positive", errBadRequest)
	}
	memory, err := bytesOfMiB("memoryMB", body.MemoryMB)
	if err != nil {
		return manager.CreateRequest{}, err
	}
	disk, err := bytesOfMiB("diskSizeMB", body.DiskSizeMB)
	if err != nil {
		return manager.CreateRequest{}, err
	}
	// E2B's defaults: the internet, and exposed ports open to anyone
	// who has the URL.
	policy, err := policyOf(body.AllowInternetAccess, body.Network)
	if err != nil {
		return manager.CreateRequest{}, err
	}
	public := body.Network.AllowPublicTraffic == nil || *body.Network.AllowPublicTraffic
	https, err := httpsPortsOf(body.Network.HTTPSPorts)
	if err != nil {
		return manager.CreateRequest{}, err
	}
	keepMemory := body.AutoPauseMemory == nil || *body.AutoPauseMemory
	autoResume := body.AutoResume != nil && body.AutoResume.Enabled
	switch {
	case !keepMemory && !body.AutoPause:
		return manager.CreateRequest{}, fmt.Errorf("%w: autoPauseMemory false needs autoPause", errBadRequest)
	case !keepMemory && autoResume:
		return manager.CreateRequest{}, fmt.Errorf("%w: autoResume needs the memory kept (autoPauseMemory true)", errBadRequest)
	}
	return manager.CreateRequest{
		Template: body.TemplateID, Timeout: timeout, Metadata: body.Metadata,
		Env: body.EnvVars, CPUs: body.CPUCount, Memory: memory, Disk: disk,
		Pids: body.Pids, Net: policy, PublicTraffic: public, HTTPSPorts: https, Wall: wall,
		AutoPause: body.AutoPause, AutoPauseMemory: keepMemory, AutoResume: autoResume,
		Volumes: volumeMountsOf(body.VolumeMounts),
	}, nil
}

// bytesOfMiB is a size in MiB of a request in bytes: MiB are the API's
// unit, bytes everyone else's. Out of range is a bad request.
func bytesOfMiB(field string, n int64) (int64, error) {
	b, err := sandbox.BytesOfMiB(field, n)
	if err != nil {
		return 0, badRequest{err}
	}
	return b, nil
}

// badRequest is an error of another kind that the API refuses as a bad
// request, its text unchanged.
type badRequest struct{ error }

func (e badRequest) Unwrap() error      { return e.error }
func (badRequest) Is(target error) bool { return target == errBadRequest }

// maxMetadataFilter bounds the keys of a list's metadata filter: each is
// a subquery of the store's list, whose statement SQLite compiles anew
// for each request. Unbounded, 900 keys (7 KB of URL) cost 65 ms of the
// daemon's CPU per request, and past 998 each request was a 500 and a
// line of the daemon's log (SQLite's expression depth); found by review,
// 2026-12-04.
const maxMetadataFilter = 32

// listFilter reads E2B's list query: metadata (URL-encoded k=v&k2=v2),
// state (running,paused), template (the name a sandbox was created from),
// startedAfter (RFC 3339, inclusive), order (asc or desc by start time;
// desc, E2B's default, when absent), limit, nextToken.
func listFilter(r *http.Request) (store.ListFilter, error) {
	q := r.URL.Query()
	f := store.ListFilter{KeyID: keyID(r), Cursor: q.Get("nextToken"), Template: q.Get("template")}
	switch o := q.Get("order"); o {
	case "", "desc":
		f.Desc = true
	case "asc":
	default:
		return f, fmt.Errorf("%w: order %q (want asc or desc)", errBadRequest, o)
	}
	if sa := q.Get("startedAfter"); sa != "" {
		t, err := time.Parse(time.RFC3339Nano, sa)
		if err != nil {
			return f, fmt.Errorf("%w: startedAfter %q is not an RFC 3339 time", errBadRequest, sa)
		}
		f.StartedAfter = t
	}
	if md := q.Get("metadata"); md != "" {
		vals, err := url.ParseQuery(md)
		if err != nil {
			return f, fmt.Errorf("%w: metadata filter: %v", errBadRequest, err)
		}
		if len(vals) > maxMetadataFilter {
			return f, fmt.Errorf("%w: metadata filter: %d keys, at most %d", errBadRequest, len(vals), maxMetadataFilter)
		}
		f.Metadata = map[string]string{}
		for k, v := range vals {
			f.Metadata[k] = v[len(v)-1]
		}
	}
	// state=running,paused as the SDKs send it, or the parameter repeated.
	for _, st := range q["state"] {
		for _, s := range strings.Split(st, ",") {
			if s != store.StateRunning && s != store.StatePaused {
				return f, fmt.Errorf("%w: state %q (want running or paused)", errBadRequest, s)
			}
			f.States = append(f.States, s)
		}
	}
	limit, err := atoiDefault(q.Get("limit"), 100)
	if err != nil {
		return f, err
	}
	if limit < 1 || limit > 100 {
		return f, fmt.Errorf("%w: limit must be between 1 and 100", errBadRequest)
	}
	f.Limit = limit
	return f, nil
}

func (s *server) listV2(w http.ResponseWriter, r *http.Request) {
	f, err := listFilter(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	items, next, err := s.listSandboxes(f)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	lw := listWriter{w: w}
	for _, rec := range items {
		lw.add(listedOf(rec))
	}
	lw.end("")
}

// listV1Page is how many records the older SDKs' list reads at a time.
const listV1Page = 32

// listV1 is the older SDKs' list: every running sandbox of the key, no
// pages for the client. It is read and written a page at a time: built
// whole, one answer held every sandbox's metadata at once, up to 384 KiB
// of JSON each (64 KiB of control characters or '<'), some 1 MiB of the
// daemon's heap per sandbox of the key (found by review, 2026-12-04).
func (s *server) listV1(w http.ResponseWriter, r *http.Request) {
	f, err := listFilter(r)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	f.Limit, f.States = listV1Page, []string{store.StateRunning}
	if s.cfg.Cluster != nil {
		// The front's list is read from its pod informer (memory it
		// holds anyway), each page from every pod: read once.
		f.Limit = 0
	}
	lw := listWriter{w: w}
	for {
		items, next, err := s.listSandboxes(f)
		if err != nil {
			if !lw.started {
				s.fail(w, r, err)
				return
			}
			// Part of the answer is sent: cut it short rather than
			// end it as if it were whole.
			s.log.Error("list sandboxes: a later page failed", "err", logged(err))
			panic(http.ErrAbortHandler)
		}
		for _, rec := range items {
			lw.add(listedOf(rec))
		}
		if next == "" {
			break
		}
		f.Cursor = next
	}
	lw.end("")
}

func (s *server) get(w http.ResponseWriter, r *http.Request) {
	rec, err := s.cfg.Manager.Get(keyID(r), r.PathValue("sandboxID"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.detailOf(rec))
}

func (s *server) kill(w http.ResponseWriter, r *http.Request) {
	if err := s.cfg.Manager.Kill(keyID(r), r.PathValue("sandboxID")); err != nil {
		s.fail(w, r, err)
		return
	}
	if s.cfg.Cluster != nil {
		s.cfg.Cluster.Killed(r.Context(), r.PathValue("sandboxID"))
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *server) timeout(w http.ResponseWriter, r *http.Request) {
	var body types.SandboxTimeoutRequest
	if err := decode(r, &body, false); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.Timeout == nil {
		s.fail(w, r, fmt.Errorf("%w: timeout is required", errBadRequest))
		return
	}
	d, err := seconds(body.Timeout, 0)
	if err == nil {
		_, err = s.cfg.Manager.SetTimeout(keyID(r), r.PathValue("sandboxID"), d)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// refresh is the older SDKs' keep-alive: live at least duration (default
// 60 s) from now.
func (s *server) refresh(w http.ResponseWriter, r *http.Request) {
	var body types.SandboxRefreshRequest
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	if body.Duration != nil && *body.Duration == 0 {
		body.Duration = nil // the server chooses
	}
	d, err := seconds(body.Duration, 60*time.Second)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if err := s.extend(r, d); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// extend makes a sandbox live at least d from now; it never shortens it.
func (s *server) extend(r *http.Request, d time.Duration) error {
	id := r.PathValue("sandboxID")
	rec, err := s.cfg.Manager.Get(keyID(r), id)
	if err != nil {
		return err
	}
	if time.Until(rec.EndAt) < d {
		_, err = s.cfg.Manager.SetTimeout(keyID(r), id, d)
	}
	return err
}

// connect returns a running sandbox and extends its life to at least timeout
// from now (E2B's connect never shortens it). Paused sandboxes do not exist
// yet, so it is always 200.
// connect returns a sandbox, resuming it first when it is paused (201) and
// extending a running one's deadline to at least timeout (200).
func (s *server) connect(v2 bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		timeout, memory, err := connectBody(r, v2)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		d, err := seconds(timeout, s.cfg.V2Timeout)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		// A connect that resumes is a create for the key's rate.
		if rec, err := s.cfg.Manager.Get(keyID(r), r.PathValue("sandboxID")); err == nil && rec.State == store.StatePaused && !s.allowCreate(w, r) {
			return
		}
		rec, resumed, err := s.cfg.Manager.Resume(r.Context(), keyID(r), r.PathValue("sandboxID"), d, memory == nil || *memory)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		status := http.StatusOK
		if resumed {
			status = http.StatusCreated
		}
		writeJSON(w, status, s.sandboxOf(rec))
	})
}

// connectBody reads a connect body's timeout and memory: v1 requires the
// timeout, and v2's body is optional.
func connectBody(r *http.Request, v2 bool) (*int64, *bool, error) {
	if v2 {
		var body types.ConnectSandboxV2
		err := decode(r, &body, true)
		return body.Timeout, body.Memory, err
	}
	var body types.ConnectSandbox
	if err := decode(r, &body, false); err != nil {
		return nil, nil, err
	}
	if body.Timeout == nil {
		return nil, nil, fmt.Errorf("%w: timeout is required", errBadRequest)
	}
	return body.Timeout, body.Memory, nil
}

// pause pauses a running sandbox: 204, 409 when it is paused already.
func (s *server) pause(w http.ResponseWriter, r *http.Request) {
	var body types.SandboxPauseRequest
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	keep := body.Memory == nil || *body.Memory
	if err := s.cfg.Manager.Pause(r.Context(), keyID(r), r.PathValue("sandboxID"), keep); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// resume is the older SDKs' resume: 201, 409 when the sandbox runs.
func (s *server) resume(w http.ResponseWriter, r *http.Request) {
	if !s.allowCreate(w, r) {
		return
	}
	var body types.ResumedSandbox
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	d, err := seconds(body.Timeout, 15*time.Second)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	id := r.PathValue("sandboxID")
	rec, err := s.cfg.Manager.Get(keyID(r), id)
	if err == nil && rec.State != store.StatePaused {
		err = fmt.Errorf("%w: sandbox %q is running", manager.ErrConflict, id)
	}
	if err == nil {
		rec, _, err = s.cfg.Manager.Resume(r.Context(), keyID(r), id, d, body.Memory == nil || *body.Memory)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxOf(rec))
}

func (s *server) metrics(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var bounds [2]time.Time
	for i, p := range []string{"start", "end"} {
		if v := q.Get(p); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 || n > 1<<40 {
				s.fail(w, r, fmt.Errorf("%w: %s %q: want Unix seconds", errBadRequest, p, v))
				return
			}
			bounds[i] = time.Unix(n, 0)
		}
	}
	ms, err := s.cfg.Manager.Metrics(keyID(r), r.PathValue("sandboxID"), bounds[0], bounds[1])
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := make([]types.SandboxMetric, 0, len(ms))
	for _, m := range ms {
		out = append(out, types.SandboxMetric{Timestamp: m.Time.UTC(), TimestampUnix: m.Time.Unix(), CPUCount: m.CPUCount,
			CPUUsedPct: m.CPUUsedPct, MemUsed: m.MemUsed, MemTotal: m.MemTotal, MemCache: m.MemCache,
			DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal})
	}
	writeJSON(w, http.StatusOK, out)
}
