package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// processService implements process.Process.
type processService struct {
	processconnect.UnimplementedProcessHandler
	s *Server

	// mu guards table. It is also held across fork and registration so that
	// the reaper (which takes it before looking a pid up) never misses a
	// child that exits at once.
	mu    sync.Mutex
	table map[int]*proc
	init  bool // the agent is PID 1 and reaps every orphan

	spawner *spawner
}

func newProcessService(s *Server) (*processService, error) {
	sp, err := newSpawner(s.cfg.SpawnThreadSetup)
	if err != nil {
		return nil, err
	}
	ps := &processService{s: s, table: map[int]*proc{}, init: os.Getpid() == 1, spawner: sp}
	if ps.init {
		absorbSignals()
		go ps.reapLoop()
	}
	return ps, nil
}

func (ps *processService) lookup(sel *pb.ProcessSelector) (*proc, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	switch {
	case sel == nil:
	case sel.GetTag() != "":
		for _, p := range ps.table {
			if p.tag == sel.GetTag() {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no process with tag %q", sel.GetTag()))
	case sel.GetPid() != 0:
		if p, ok := ps.table[int(sel.GetPid())]; ok {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("no process with pid %d", sel.GetPid()))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("a process selector (pid or tag) is required"))
}

func (ps *processService) List(ctx context.Context, req *connect.Request[pb.ListRequest]) (*connect.Response[pb.ListResponse], error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := &pb.ListResponse{}
	for _, p := range ps.table {
		info := &pb.ProcessInfo{Config: p.config, Pid: uint32(p.pid)}
		if p.tag != "" {
			tag := p.tag
			info.Tag = &tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (ps *processService) Start(ctx context.Context, req *connect.Request[pb.StartRequest], stream *connect.ServerStream[pb.StartResponse]) error {
	trace("agent: Start")
	user, err := ps.s.requestUser(req.Header())
	if err != nil {
		return err
	}
	p, s, err := ps.start(req.Msg, user)
	if err != nil {
		return err
	}
	return follow(ctx, req.Header(), p, s, func(ev *pb.ProcessEvent) error {
		return stream.Send(&pb.StartResponse{Event: ev})
	})
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[pb.ConnectRequest], stream *connect.ServerStream[pb.ConnectResponse]) error {
	p, err := ps.lookup(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	return follow(ctx, req.Header(), p, p.subscribe(), func(ev *pb.ProcessEvent) error {
		return stream.Send(&pb.ConnectResponse{Event: ev})
	})
}

// follow streams a process's events to one client: `start` first, then
// output, keepalives, and `end`. A client that leaves detaches; the process
// keeps running.
func follow(ctx context.Context, h interface{ Get(string) string }, p *proc, s *sub, send func(*pb.ProcessEvent) error) error {
	defer p.unsubscribe(s)
	start := &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: uint32(p.pid)}}}
	if err := send(start); err != nil {
		return err
	}
	var tick <-chan time.Time
	if sec, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval")); err == nil && sec > 0 {
		t := time.NewTicker(time.Duration(sec) * time.Second)
		defer t.Stop()
		tick = t.C
	}
	keepalive := &pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}
	for {
		select {
		case ev, ok := <-s.events:
			if !ok {
				return nil
			}
			if err := send(ev); err != nil {
				return err
			}
		case <-tick:
			if err := send(keepalive); err != nil {
				return err
			}
		case <-ctx.Done():
			return nil
		}
	}
}

func (ps *processService) Update(ctx context.Context, req *connect.Request[pb.UpdateRequest]) (*connect.Response[pb.UpdateResponse], error) {
	p, err := ps.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if size := req.Msg.GetPty().GetSize(); size != nil {
		if p.pty == nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the process has no PTY"))
		}
		if err := pty.Setsize(p.pty, &pty.Winsize{Rows: uint16(size.Rows), Cols: uint16(size.Cols)}); err != nil {
			return nil, connect.NewError(connect.CodeInternal, err)
		}
	}
	return connect.NewResponse(&pb.UpdateResponse{}), nil
}

func (ps *processService) SendInput(ctx context.Context, req *connect.Request[pb.SendInputRequest]) (*connect.Response[pb.SendInputResponse], error) {
	p, err := ps.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.writeInput(req.Msg.GetInput()); err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, err)
	}
	return connect.NewResponse(&pb.SendInputResponse{}), nil
}

func (ps *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[pb.StreamInputRequest]) (*connect.Response[pb.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.Event.(type) {
		case *pb.StreamInputRequest_Start:
			var err error
			if p, err = ps.lookup(ev.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *pb.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message must be start"))
			}
			if err := p.writeInput(ev.Data.GetInput()); err != nil {
				return nil, connect.NewError(connect.CodeFailedPrecondition, err)
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StreamInputResponse{}), nil
}

func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	p, err := ps.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case pb.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case pb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("unsupported signal"))
	}
	if err := p.signal(sig); err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[pb.CloseStdinRequest]) (*connect.Response[pb.CloseStdinResponse], error) {
	p, err := ps.lookup(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.closeStdin(); err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, err)
	}
	return connect.NewResponse(&pb.CloseStdinResponse{}), nil
}

// killAll kills every process group the agent started.
func (ps *processService) killAll() { ps.signalAll(syscall.SIGKILL) }

// signalAll signals every process group the agent started.
func (ps *processService) signalAll(sig syscall.Signal) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.table {
		_ = p.signal(sig)
	}
}

// commandEnv builds a process's environment: defaults for the user, then the
// sandbox's environment, then the request's.
func (ps *processService) commandEnv(user User, req map[string]string) []string {
	env := map[string]string{
		"PATH":    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME":    user.Home,
		"USER":    user.Name,
		"LOGNAME": user.Name,
		"SHELL":   "/bin/bash",
		"LANG":    "C.UTF-8",
	}
	for k, v := range ps.s.cfg.Env {
		env[k] = v
	}
	for k, v := range req {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// lookPath finds cmd in the PATH of the process's own environment.
func lookPath(cmd string, env []string) (string, error) {
	if cmd == "" {
		return "", connect.NewError(connect.CodeInvalidArgument, errors.New("empty command"))
	}
	if strings.Contains(cmd, "/") {
		return cmd, nil
	}
	path := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			continue
		}
		full := filepath.Join(dir, cmd)
		if fi, err := os.Stat(full); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return full, nil
		}
	}
	return "", connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: command not found", cmd))
}
