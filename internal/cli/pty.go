package cli

import (
	"context"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/term"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
)

// setupPTY makes the run interactive: the command gets a PTY the size of
// the caller's terminal, the terminal goes raw (so Ctrl-C and friends reach
// the command as bytes), and resizes follow. It returns the undo.
func setupPTY(ctx context.Context, c *agentclient.Client, opts *agentclient.RunOptions) func() {
	fd := int(os.Stdin.Fd())
	cols, rows := 80, 24
	if w, h, err := term.GetSize(fd); err == nil && w > 0 && h > 0 {
		cols, rows = w, h
	}
	opts.PTY = &pb.PTY_Size{Cols: uint32(cols), Rows: uint32(rows)}
	if opts.Env == nil {
		opts.Env = map[string]string{}
	}
	if _, ok := opts.Env["TERM"]; !ok {
		opts.Env["TERM"] = "xterm-256color"
		if t := os.Getenv("TERM"); t != "" {
			opts.Env["TERM"] = t
		}
	}
	opts.Stdin = os.Stdin
	var pid atomic.Uint32
	prev := opts.OnStart
	opts.OnStart = func(p uint32) {
		pid.Store(p)
		if prev != nil {
			prev(p)
		}
	}

	var old *term.State
	if term.IsTerminal(fd) {
		old, _ = term.MakeRaw(fd)
	}
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-winch:
				w, h, err := term.GetSize(fd)
				if err != nil || pid.Load() == 0 {
					continue
				}
				sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid.Load()}}
				size := &pb.PTY{Size: &pb.PTY_Size{Cols: uint32(w), Rows: uint32(h)}}
				_, _ = c.Process.Update(ctx, connect.NewRequest(&pb.UpdateRequest{Process: sel, Pty: size}))
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(winch)
		close(done)
		if old != nil {
			_ = term.Restore(fd, old)
		}
	}
}
