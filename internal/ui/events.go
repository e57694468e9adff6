package ui

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/api"
)

// Live pages are server-sent events: the server asks the API every tick,
// as the session's key, and sends what changed.
const (
	listTick   = 2 * time.Second
	detailTick = 2 * time.Second
	// listUsageRows bounds the rows of a list whose CPU and memory are
	// looked up each tick.
	listUsageRows = 50
	listLimit     = 100
)

// sse is one event stream.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// startSSE begins an event stream. The API listener bounds the time to
// read a request; a stream has read its request and lives on.
func startSSE(w http.ResponseWriter) *sse {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{})
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	_ = rc.Flush()
	return &sse{w: w, rc: rc}
}

func (e *sse) send(event string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(e.w, "event: %s\ndata: %s\n\n", event, b); err != nil {
		return err
	}
	return e.rc.Flush()
}

func (e *sse) comment() error {
	if _, err := e.w.Write([]byte(": tick\n\n")); err != nil {
		return err
	}
	return e.rc.Flush()
}

// row is a sandbox of the live list.
type row struct {
	types.ListedSandbox
	CPUPct  *float64 `json:"cpuPct,omitempty"`
	MemUsed *int64   `json:"memUsed,omitempty"`
}

// listEvents streams the key's sandboxes ("list" events), filtered as
// the API filters (state, metadata as k=v&k2=v2, template).
func (s *Server) listEvents(w http.ResponseWriter, r *http.Request) {
	release, ok := holdStream(w, r)
	if !ok {
		return
	}
	defer release()
	q := url.Values{"limit": {strconv.Itoa(listLimit)}}
	for _, k := range []string{"state", "metadata", "template"} {
		if v := r.URL.Query().Get(k); v != "" {
			q.Set(k, v)
		}
	}
	path := "/v2/sandboxes?" + q.Encode()
	// A bad filter is the API's 400, before the stream starts.
	var first []types.ListedSandbox
	if err := s.call(r.Context(), r, http.MethodGet, path, nil, &first); err != nil {
		failAPI(w, err)
		return
	}
	ev := startSSE(w)
	s.stream(r, ev, listTick, func(ctx context.Context) (string, any, error) {
		var items []types.ListedSandbox
		if err := s.call(ctx, r, http.MethodGet, path, nil, &items); err != nil {
			return "", nil, err
		}
		rows := make([]row, 0, len(items))
		for i, it := range items {
			x := row{ListedSandbox: it}
			if i < listUsageRows && it.State == types.SandboxStateRunning {
				if m := s.lastMetric(ctx, r, it.SandboxID); m != nil {
					x.CPUPct, x.MemUsed = &m.CPUUsedPct, &m.MemUsed
				}
			}
			rows = append(rows, x)
		}
		return "list", rows, nil
	})
}

func (s *Server) lastMetric(ctx context.Context, r *http.Request, id string) *types.SandboxMetric {
	var ms []types.SandboxMetric
	start := strconv.FormatInt(s.now().Add(-30*time.Second).Unix(), 10)
	if s.call(ctx, r, http.MethodGet, "/sandboxes/"+url.PathEscape(id)+"/metrics?start="+start, nil, &ms) != nil || len(ms) == 0 {
		return nil
	}
	return &ms[len(ms)-1]
}

// stream sends what next gives every tick, when it changed (a comment
// otherwise, so a dead client is found), until the client leaves, the
// session ends ("expired") or the API refuses ("error").
func (s *Server) stream(r *http.Request, ev *sse, tick time.Duration, next func(context.Context) (string, any, error)) {
	ctx, cancel := s.streamContext(r)
	defer cancel()
	ctx = api.Quiet(ctx) // polls are not the key's doing: not in the audit trail
	var last []byte
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		if !s.alive(r) {
			_ = ev.send("expired", errorJSON{Code: http.StatusUnauthorized, Message: "session expired: sign in again"})
			return
		}
		name, v, err := next(ctx)
		if ctx.Err() != nil {
			sessionEnded(ctx, ev)
			return
		}
		if err != nil {
			status := http.StatusBadGateway
			if ae, ok := err.(*apiError); ok {
				status = ae.status
			}
			_ = ev.send("error", errorJSON{Code: status, Message: err.Error()})
			return
		}
		b, _ := json.Marshal(v)
		if !bytes.Equal(b, last) {
			if ev.send(name, json.RawMessage(b)) != nil {
				return
			}
			last = b
		} else if ev.comment() != nil {
			return
		}
		select {
		case <-ctx.Done():
			sessionEnded(ctx, ev)
			return
		case <-t.C:
		}
	}
}

// detail is one sandbox's page.
type detail struct {
	Sandbox   types.SandboxDetail   `json:"sandbox"`
	Metrics   []types.SandboxMetric `json:"metrics"`
	Records   []types.NetworkRecord `json:"records"`
	Audit     []types.AuditEntry    `json:"audit"`
	Processes []process             `json:"processes"`
	Note      string                `json:"note,omitempty"`
}

type process struct {
	Pid  uint32   `json:"pid"`
	Cmd  string   `json:"cmd"`
	Args []string `json:"args"`
	Tag  string   `json:"tag,omitempty"`
}

// sandboxEvents streams one sandbox ("sandbox" events): its record, the
// last ten minutes of metrics, network records, audit entries and, while
// it runs, its agent's processes.
func (s *Server) sandboxEvents(w http.ResponseWriter, r *http.Request) {
	release, ok := holdStream(w, r)
	if !ok {
		return
	}
	defer release()
	id := r.PathValue("id")
	base := "/sandboxes/" + url.PathEscape(id)
	var first types.SandboxDetail
	if err := s.call(r.Context(), r, http.MethodGet, base, nil, &first); err != nil {
		failAPI(w, err)
		return
	}
	ev := startSSE(w)
	var ag *agentclient.Client
	defer func() {
		if ag != nil {
			ag.Close()
		}
	}()
	s.stream(r, ev, detailTick, func(ctx context.Context) (string, any, error) {
		var d detail
		if err := s.call(ctx, r, http.MethodGet, base, nil, &d.Sandbox); err != nil {
			return "", nil, err
		}
		d.Sandbox.EnvdAccessToken, d.Sandbox.TrafficAccessToken = "", nil // the browser never needs them
		start := strconv.FormatInt(s.now().Add(-10*time.Minute).Unix(), 10)
		if err := s.call(ctx, r, http.MethodGet, base+"/metrics?start="+start, nil, &d.Metrics); err != nil {
			d.Note = err.Error()
		}
		var recs types.NetworkRecords
		if err := s.call(ctx, r, http.MethodGet, base+"/network/records?limit=100", nil, &recs); err == nil {
			d.Records = recs.Records
		}
		var page types.AuditPage
		if err := s.call(ctx, r, http.MethodGet, "/audit?limit=50&sandboxID="+url.QueryEscape(id), nil, &page); err == nil {
			d.Audit = page.Entries
		}
		if d.Sandbox.State == types.SandboxStateRunning {
			if ag == nil {
				ag, _, _ = s.agentOf(r, id)
			}
			if ag != nil {
				d.Processes = processes(ctx, ag)
			}
		} else if ag != nil {
			ag.Close()
			ag = nil
		}
		return "sandbox", d, nil
	})
}

func processes(ctx context.Context, ag *agentclient.Client) []process {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := ag.Process.List(ctx, connect.NewRequest(&pb.ListRequest{}))
	if err != nil {
		return nil
	}
	out := []process{}
	for _, p := range resp.Msg.GetProcesses() {
		out = append(out, process{Pid: p.GetPid(), Cmd: p.GetConfig().GetCmd(), Args: p.GetConfig().GetArgs(), Tag: p.GetTag()})
	}
	return out
}
