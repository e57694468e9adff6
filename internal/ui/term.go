package ui

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
)

// A terminal is a login shell in a PTY in the sandbox, started through
// the agent (envd's process.Start with a PTY) for one session: its output
// is an event stream (GET /ui/term/{id}), its input and size are POSTs
// naming the terminal. It ends when the stream's client leaves, the shell
// exits, or the session signs out; the shell is then killed.
const (
	maxTermsPerSession = 8
	maxTermInput       = 64 << 10
	maxTermSide        = 1000
	// shell is what a terminal runs: bash as a login shell where the
	// template has it, else sh.
	shell = "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"
)

type terminal struct {
	id, session, sandbox string
	ag                   *agentclient.Client
	cancel               context.CancelFunc

	mu  sync.Mutex
	pid uint32
}

func (t *terminal) selector() (*pb.ProcessSelector, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: t.pid}}, t.pid != 0
}

type terminals struct {
	mu sync.Mutex
	m  map[string]*terminal
}

func newTerminals() *terminals { return &terminals{m: map[string]*terminal{}} }

func (ts *terminals) add(t *terminal) bool {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	n := 0
	for _, x := range ts.m {
		if x.session == t.session {
			n++
		}
	}
	if n >= maxTermsPerSession {
		return false
	}
	ts.m[t.id] = t
	return true
}

// get is a terminal of this session and sandbox (nil otherwise).
func (ts *terminals) get(id, session, sandbox string) *terminal {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	t := ts.m[id]
	if t == nil || t.session != session || t.sandbox != sandbox {
		return nil
	}
	return t
}

func (ts *terminals) remove(id string) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	delete(ts.m, id)
}

func (ts *terminals) closeSession(session string) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for _, t := range ts.m {
		if t.session == session {
			t.cancel()
		}
	}
}

func termSize(q string, def uint32) (uint32, bool) {
	if q == "" {
		return def, true
	}
	n, err := strconv.Atoi(q)
	if err != nil || n < 1 || n > maxTermSide {
		return 0, false
	}
	return uint32(n), true
}

// termStream starts a shell in a PTY of cols x rows and streams it:
// "start" {term, pid}, "out" (base64 of the PTY's bytes, as JSON), "end"
// {exitCode, status}.
func (s *Server) termStream(w http.ResponseWriter, r *http.Request) {
	release, ok := holdStream(w, r)
	if !ok {
		return
	}
	defer release()
	id := r.PathValue("id")
	cols, ok1 := termSize(r.URL.Query().Get("cols"), 80)
	rows, ok2 := termSize(r.URL.Query().Get("rows"), 24)
	if !ok1 || !ok2 {
		writeError(w, http.StatusBadRequest, "cols and rows: want 1 to 1000")
		return
	}
	ag, _, err := s.agentOf(r, id)
	if err != nil {
		failAPI(w, err)
		return
	}
	defer ag.Close()
	ctx, cancel := s.streamContext(r)
	defer cancel()
	t := &terminal{id: randomID()[:24], session: sessionOf(r).id, sandbox: id, ag: ag, cancel: cancel}
	if !s.terms.add(t) {
		writeError(w, http.StatusTooManyRequests, "too many terminals open in this session")
		return
	}
	defer s.terms.remove(t.id)
	stdin := true
	req := connect.NewRequest(&pb.StartRequest{
		Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", shell}, Envs: map[string]string{"TERM": "xterm-256color"}},
		Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: cols, Rows: rows}}, Stdin: &stdin})
	stream, err := ag.Process.Start(ctx, req)
	if err != nil {
		writeError(w, http.StatusBadGateway, "start a shell: "+err.Error())
		return
	}
	defer stream.Close()
	defer func() { // the shell goes with its terminal
		if sel, ok := t.selector(); ok {
			kctx, kcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer kcancel()
			_, _ = ag.Process.SendSignal(kctx, connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGKILL}))
		}
	}()
	relay(ctx, t, stream, startSSE(w))
}

// relay passes the shell's events to the browser until it ends or the
// stream breaks.
func relay(ctx context.Context, t *terminal, stream *connect.ServerStreamForClient[pb.StartResponse], ev *sse) {
	for stream.Receive() {
		switch e := stream.Msg().GetEvent().GetEvent().(type) {
		case *pb.ProcessEvent_Start:
			t.mu.Lock()
			t.pid = e.Start.GetPid()
			t.mu.Unlock()
			_ = ev.send("start", map[string]any{"term": t.id, "pid": e.Start.GetPid()})
		case *pb.ProcessEvent_Data:
			b := e.Data.GetPty()
			if b == nil {
				b = append(append([]byte(nil), e.Data.GetStdout()...), e.Data.GetStderr()...)
			}
			if len(b) > 0 && ev.send("out", b) != nil { // []byte: base64 in JSON
				return
			}
		case *pb.ProcessEvent_End:
			t.mu.Lock()
			t.pid = 0 // nothing left to kill
			t.mu.Unlock()
			_ = ev.send("end", map[string]any{"exitCode": e.End.GetExitCode(), "status": e.End.GetStatus()})
			return
		}
	}
	if sessionEnded(ctx, ev) {
		return
	}
	if err := stream.Err(); err != nil && ctx.Err() == nil {
		_ = ev.send("error", errorJSON{Code: http.StatusBadGateway, Message: err.Error()})
	}
}

func (s *Server) termOf(w http.ResponseWriter, r *http.Request) (*terminal, *pb.ProcessSelector) {
	t := s.terms.get(r.PathValue("term"), sessionOf(r).id, r.PathValue("id"))
	if t == nil {
		writeError(w, http.StatusNotFound, "no such terminal")
		return nil, nil
	}
	sel, ok := t.selector()
	if !ok {
		writeError(w, http.StatusConflict, "the terminal has not started or has ended")
		return nil, nil
	}
	return t, sel
}

// termInput sends the body (keys typed, at most 64 KiB) to the PTY.
func (s *Server) termInput(w http.ResponseWriter, r *http.Request) {
	t, sel := s.termOf(w, r)
	if t == nil {
		return
	}
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxTermInput))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "input over 64 KiB")
			return
		}
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	in := &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: b}}
	if _, err := t.ag.Process.SendInput(r.Context(), connect.NewRequest(&pb.SendInputRequest{Process: sel, Input: in})); err != nil {
		writeError(w, http.StatusBadGateway, err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// termResize sets the PTY's size ({"cols": N, "rows": N}).
func (s *Server) termResize(w http.ResponseWriter, r *http.Request) {
	t, sel := s.termOf(w, r)
	if t == nil {
		return
	}
	var size struct{ Cols, Rows int }
	if err := json.NewDecoder(io.LimitReader(r.Body, 1024)).Decode(&size); err != nil ||
		size.Cols < 1 || size.Rows < 1 || size.Cols > maxTermSide || size.Rows > maxTermSide {
		writeError(w, http.StatusBadRequest, "want {\"cols\": 1-1000, \"rows\": 1-1000}")
		return
	}
	pty := &pb.PTY{Size: &pb.PTY_Size{Cols: uint32(size.Cols), Rows: uint32(size.Rows)}}
	if _, err := t.ag.Process.Update(r.Context(), connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: pty})); err != nil {
		writeError(w, http.StatusBadGateway, err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
