package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/build"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/imgstore"
)

// Template builds, for an admin key: the Dockerfile comes in the body and
// there is no build context (COPY and ADD are refused before anything
// runs), one build runs at a time, and its log is kept in memory (the last
// maxBuildLog bytes of each of the last keptBuilds builds) to be read
// whole or followed by long poll. The build itself is Config.Build's
// (the daemon's internal/build, whose RUN steps run in sandboxes).

const (
	maxDockerfile = 64 << 10
	// maxBuildBody leaves room for the JSON's escapes and the arguments.
	maxBuildBody = 2*maxDockerfile + 16<<10
	maxBuildArgs = 64
	maxBuildLog  = 1 << 20
	keptBuilds   = 8
	// defaultLogWait and maxLogWait bound a long poll of the log.
	defaultLogWait = 20 * time.Second
	maxLogWait     = 60 * time.Second
)

// BuildJob is one template build as the API hands it to Config.Build.
type BuildJob struct {
	ID, Template, Dockerfile string
	Args                     map[string]string
	Internet                 bool          // the RUN steps' network: the internet, or none
	KeyID                    string        // the admin key that asked
	StepTimeout              time.Duration // the most each RUN step may run
}

// BuildFunc builds job into the template store, writing its log to out,
// and returns the template's id;
// an error wrapping build.ErrFailed is the Dockerfile's fault and is shown
// to the key as it is. It runs until the build ends or the daemon stops
// (ctx carries no deadline of the request's), or until ctx is cancelled
// (DELETE of the build), when it stops its step's sandbox, removes what it
// staged and returns.
type BuildFunc func(ctx context.Context, job BuildJob, out io.Writer) (templateID string, err error)

type builds struct {
	mu      sync.Mutex
	running *buildRun
	kept    []*buildRun // oldest first
}

// buildRun is one build and its log.
type buildRun struct {
	job      BuildJob
	network  types.TemplateBuildNetwork
	started  time.Time
	mu       sync.Mutex
	changed  chan struct{} // closed and replaced at each write and at the end
	log      []byte        // the log's tail: at least its last maxBuildLog bytes
	dropped  int64         // bytes of the log before log[0]
	state    types.TemplateBuildState
	errMsg   string
	finished time.Time
	made     string // the template's id
	// cancel stops the build; cancelledBy is the key that did, once it
	// has (b.mu).
	cancel      context.CancelFunc
	cancelledBy string
	done        chan struct{} // closed at the build's end
}

// Write appends to the log, keeping its tail.
func (b *buildRun) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.log = append(b.log, p...)
	if len(b.log) > 2*maxBuildLog { // trimmed now and then, not at every write
		over := len(b.log) - maxBuildLog
		b.log = append([]byte(nil), b.log[over:]...)
		b.dropped += int64(over)
	}
	close(b.changed)
	b.changed = make(chan struct{})
	return len(p), nil
}

func (b *buildRun) finish(state types.TemplateBuildState, msg, made string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.state, b.errMsg, b.made, b.finished = state, msg, made, time.Now()
	close(b.changed)
	b.changed = make(chan struct{})
}

// window is the kept log (its last maxBuildLog bytes) and where it begins.
// b.mu is held.
func (b *buildRun) window() ([]byte, int64) {
	l, start := b.log, b.dropped
	if over := len(l) - maxBuildLog; over > 0 {
		l, start = l[over:], start+int64(over)
	}
	return l, start
}

// view is the build as the API shows it, with its log when withLog.
func (b *buildRun) view(withLog bool) types.TemplateBuild {
	b.mu.Lock()
	defer b.mu.Unlock()
	v := types.TemplateBuild{BuildID: b.job.ID, Template: b.job.Template, State: b.state, Network: b.network,
		StartedAt: b.started, FinishedAt: b.finished, Error: b.errMsg, TemplateID: b.made,
		StepTimeout: int(b.job.StepTimeout / time.Second)}
	if withLog {
		l, start := b.window()
		v.Log, v.LogOffset = string(l), start
	}
	return v
}

// from is the log from offset on (from the kept window's start when
// offset is older), the channel that says when there is more, and whether
// the build has ended. A rune cut at the end waits for its rest.
func (b *buildRun) from(offset int64) (types.TemplateBuildLog, <-chan struct{}, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	l, start := b.window()
	end := start + int64(len(l))
	out := types.TemplateBuildLog{State: types.TemplateBuildLogState(b.state), Error: b.errMsg}
	if offset < start {
		offset, out.Truncated = start, true
	}
	offset = min(offset, end)
	text := l[offset-start:]
	if b.state == types.TemplateBuildStateBuilding {
		text = text[:completeRunes(text)]
	}
	out.Offset, out.Next, out.Text = offset, offset+int64(len(text)), string(text)
	return out, b.changed, b.state != types.TemplateBuildStateBuilding
}

// completeRunes is the length of b without a UTF-8 sequence cut at its end.
func completeRunes(b []byte) int {
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return i
			}
			break
		}
	}
	return len(b)
}

func (s *server) buildRoutes(mux *http.ServeMux) {
	admin := func(h http.HandlerFunc) http.Handler { return s.authenticated(s.adminOnly(h)) }
	mux.Handle("POST /admin/templates/{templateName}/builds", admin(s.startBuild))
	mux.Handle("GET /admin/templates/builds", admin(s.listBuilds))
	mux.Handle("GET /admin/templates/builds/{buildID}", admin(s.getBuild))
	mux.Handle("DELETE /admin/templates/builds/{buildID}", admin(s.cancelBuild))
	mux.Handle("GET /admin/templates/builds/{buildID}/log", admin(s.buildLog))
}

// buildJob reads and checks a build request: 400 or 413 before anything
// runs.
func buildJob(w http.ResponseWriter, r *http.Request) (BuildJob, types.TemplateBuildNetwork, error) {
	name := r.PathValue("templateName")
	if err := imgstore.CheckName(name); err != nil {
		return BuildJob{}, "", fmt.Errorf("%w: %v", errBadRequest, err)
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBuildBody)
	var body types.TemplateBuildRequest
	if err := decode(r, &body, false); err != nil {
		return BuildJob{}, "", err
	}
	if len(body.Dockerfile) > maxDockerfile {
		return BuildJob{}, "", &http.MaxBytesError{Limit: maxDockerfile}
	}
	network := types.TemplateBuildNetworkNone
	switch body.Network {
	case "", types.TemplateBuildRequestNetworkNone:
	case types.TemplateBuildRequestNetworkInternet:
		network = types.TemplateBuildNetworkInternet
	default:
		return BuildJob{}, "", fmt.Errorf("%w: network %q: want none or internet", errBadRequest, body.Network)
	}
	if len(body.BuildArgs) > maxBuildArgs {
		return BuildJob{}, "", fmt.Errorf("%w: buildArgs: at most %d", errBadRequest, maxBuildArgs)
	}
	stepTimeout := build.DefaultStepTimeout
	if body.StepTimeout != 0 {
		// Checked before it is multiplied: seconds as nanoseconds wrap.
		if body.StepTimeout < 1 || body.StepTimeout > int(build.MaxStepTimeout/time.Second) {
			return BuildJob{}, "", fmt.Errorf("%w: stepTimeout %d: want 1 to %d seconds", errBadRequest, body.StepTimeout, int(build.MaxStepTimeout/time.Second))
		}
		stepTimeout = time.Duration(body.StepTimeout) * time.Second
	}
	for k := range body.BuildArgs {
		if k == "" || strings.ContainsAny(k, "= \t\n$") {
			return BuildJob{}, "", fmt.Errorf("%w: buildArgs: %q is not an ARG name", errBadRequest, k)
		}
	}
	steps, err := build.Parse(strings.NewReader(body.Dockerfile))
	if err != nil {
		return BuildJob{}, "", fmt.Errorf("%w: %v", errBadRequest, err)
	}
	var refused []string
	for _, in := range steps {
		if in.Cmd == "COPY" || in.Cmd == "ADD" {
			refused = append(refused, fmt.Sprintf("%s on line %d", in.Cmd, in.Line))
		}
	}
	if len(refused) > 0 {
		return BuildJob{}, "", fmt.Errorf("%w: %s: a build through the API has no build context (it would be the host's files), so COPY and ADD are refused; build on the host with cage template build CONTEXT NAME",
			errBadRequest, strings.Join(refused, ", "))
	}
	return BuildJob{ID: "build_" + ids.NewToken()[:16], Template: name, Dockerfile: body.Dockerfile, Args: body.BuildArgs,
		Internet: network == types.TemplateBuildNetworkInternet, KeyID: callerOf(r).ID, StepTimeout: stepTimeout}, network, nil
}

// startBuild starts a build: 202 with its id, 409 while another runs.
func (s *server) startBuild(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Build == nil {
		writeError(w, http.StatusServiceUnavailable, "this daemon builds no templates")
		return
	}
	job, network, err := buildJob(w, r)
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the Dockerfile may be %d bytes at most (and the body %d)", maxDockerfile, maxBuildBody))
			return
		}
		s.fail(w, r, err)
		return
	}
	b := &buildRun{job: job, network: network, started: time.Now(), changed: make(chan struct{}), state: types.TemplateBuildStateBuilding,
		done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.Context()))
	b.cancel = cancel
	s.builds.mu.Lock()
	if cur := s.builds.running; cur != nil {
		s.builds.mu.Unlock()
		cancel()
		writeError(w, http.StatusConflict, fmt.Sprintf("build %s (template %s) is running: one build at a time", cur.job.ID, cur.job.Template))
		return
	}
	s.builds.running = b
	s.builds.kept = append(s.builds.kept, b)
	if len(s.builds.kept) > keptBuilds {
		s.builds.kept = append([]*buildRun(nil), s.builds.kept[len(s.builds.kept)-keptBuilds:]...)
	}
	s.builds.mu.Unlock()
	s.adminEvent(r, "template.build", map[string]any{"buildID": job.ID, "template": job.Template, "network": string(network)})
	k := callerOf(r)
	go s.runBuild(ctx, b, k.ID, k.TeamID)
	writeJSON(w, http.StatusAccepted, b.view(false))
}

// runBuild runs b to its end, says in its log how it ended, and records
// the end in the audit trail as the key's.
func (s *server) runBuild(ctx context.Context, b *buildRun, keyID, teamID string) {
	defer func() {
		s.builds.mu.Lock()
		s.builds.running = nil
		s.builds.mu.Unlock()
		b.cancel()
		close(b.done)
	}()
	made, err := s.cfg.Build(ctx, b.job, b)
	b.mu.Lock()
	by := b.cancelledBy
	b.mu.Unlock()
	state, msg := types.TemplateBuildStateSucceeded, ""
	switch {
	case err == nil:
	case by != "" && errors.Is(err, context.Canceled):
		state, msg = types.TemplateBuildStateFailed, "cancelled by key "+by
	case errors.Is(err, build.ErrFailed), errors.Is(err, build.ErrNoMmdebstrap), errors.Is(err, imgstore.ErrInvalid):
		state, msg = types.TemplateBuildStateFailed, err.Error()
	case errors.Is(err, context.Canceled):
		state, msg = types.TemplateBuildStateFailed, "the daemon stopped during the build"
	default:
		id := requestID()
		s.log.Error("template build failed", "build", b.job.ID, "template", b.job.Template, "request", id, "err", err)
		state, msg = types.TemplateBuildStateFailed, "internal error (request "+id+"; the server's log has the detail)"
	}
	if msg != "" {
		fmt.Fprintf(b, "build failed: %s\n", msg)
	}
	s.cfg.Audit.Record(audit.Event{Kind: "template.built", KeyID: keyID, TeamID: teamID,
		Detail: map[string]any{"buildID": b.job.ID, "template": b.job.Template, "state": string(state), "error": msg}})
	b.finish(state, msg, made)
}

func (s *server) build(id string) *buildRun {
	s.builds.mu.Lock()
	defer s.builds.mu.Unlock()
	for _, b := range s.builds.kept {
		if b.job.ID == id {
			return b
		}
	}
	return nil
}

// cancelBuild stops a running build and waits (at most maxLogWait) for it
// to end: 200 with the build once ended, 202 while it still stops, 409
// when it had ended already.
func (s *server) cancelBuild(w http.ResponseWriter, r *http.Request) {
	b := s.build(r.PathValue("buildID"))
	if b == nil {
		writeError(w, http.StatusNotFound, "no such build (the daemon keeps its last "+strconv.Itoa(keptBuilds)+")")
		return
	}
	b.mu.Lock()
	state := b.state
	if state == types.TemplateBuildStateBuilding && b.cancelledBy == "" {
		b.cancelledBy = callerOf(r).ID
	}
	b.mu.Unlock()
	if state != types.TemplateBuildStateBuilding {
		writeError(w, http.StatusConflict, fmt.Sprintf("build %s has ended (%s): nothing to cancel", b.job.ID, state))
		return
	}
	s.adminEvent(r, "template.build.cancel", map[string]any{"buildID": b.job.ID, "template": b.job.Template})
	b.cancel()
	_ = http.NewResponseController(w).SetReadDeadline(time.Time{})
	timer := time.NewTimer(maxLogWait)
	defer timer.Stop()
	select {
	case <-b.done:
		writeJSON(w, http.StatusOK, b.view(false))
	case <-timer.C:
		writeJSON(w, http.StatusAccepted, b.view(false))
	case <-r.Context().Done():
	}
}

func (s *server) listBuilds(w http.ResponseWriter, r *http.Request) {
	s.builds.mu.Lock()
	kept := append([]*buildRun(nil), s.builds.kept...)
	s.builds.mu.Unlock()
	out := make([]types.TemplateBuild, 0, len(kept))
	for i := len(kept) - 1; i >= 0; i-- {
		out = append(out, kept[i].view(false))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) getBuild(w http.ResponseWriter, r *http.Request) {
	b := s.build(r.PathValue("buildID"))
	if b == nil {
		writeError(w, http.StatusNotFound, "no such build (the daemon keeps its last "+strconv.Itoa(keptBuilds)+")")
		return
	}
	writeJSON(w, http.StatusOK, b.view(true))
}

// buildLog answers the log from ?offset= as soon as there is some, or at
// the build's end, or after ?wait= seconds.
func (s *server) buildLog(w http.ResponseWriter, r *http.Request) {
	b := s.build(r.PathValue("buildID"))
	if b == nil {
		writeError(w, http.StatusNotFound, "no such build (the daemon keeps its last "+strconv.Itoa(keptBuilds)+")")
		return
	}
	q := r.URL.Query()
	offset, err := strconv.ParseInt(q.Get("offset"), 10, 64)
	if q.Get("offset") == "" {
		offset, err = 0, nil
	}
	if err != nil || offset < 0 {
		s.fail(w, r, fmt.Errorf("%w: offset %q: want a byte offset (0 or more)", errBadRequest, q.Get("offset")))
		return
	}
	wait, err := atoiDefault(q.Get("wait"), int(defaultLogWait/time.Second))
	if err != nil || wait < 0 || time.Duration(wait)*time.Second > maxLogWait {
		s.fail(w, r, fmt.Errorf("%w: wait %q: want 0 to %d seconds", errBadRequest, q.Get("wait"), int(maxLogWait/time.Second)))
		return
	}
	// The request is read: the listener's bound on reading one (a minute)
	// must not end a wait (a background read's timeout cancels r's
	// context).
	_ = http.NewResponseController(w).SetReadDeadline(time.Time{})
	timer := time.NewTimer(time.Duration(wait) * time.Second)
	defer timer.Stop()
	for {
		out, more, done := b.from(offset)
		if out.Text != "" || out.Truncated || done {
			writeJSON(w, http.StatusOK, out)
			return
		}
		select {
		case <-more:
		case <-timer.C:
			writeJSON(w, http.StatusOK, out)
			return
		case <-r.Context().Done():
			return
		}
	}
}
