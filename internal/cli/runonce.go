package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/wall"
)

// runOnce is cage run's one-shot path (no PTY, nothing to copy in, a wall
// that can): the sandbox is made for the command, whose agent starts it
// as soon as it is sealed, on pipes this process made. Its output goes
// straight into them, and this process copies it out; no RPC, no agent
// server, nothing copied through the agent. The sandbox holds only pipe
// ends, never a descriptor of the caller's (a terminal, a file): those
// this process reads and writes itself. sandbox.ErrNoOneShot (nothing
// made) when the sandbox cannot be made so.
func runOnce(ctx context.Context, host *sandbox.Host, p *parsed, f *runFlags, args []string, stdout, stderr io.Writer) error {
	pp, err := newOneShotPipes()
	if err != nil {
		return exitf(ExitInternal, "pipes: %v", err)
	}
	defer pp.close()
	opts := p.opts
	opts.Run = &wall.Run{Cmd: args[0], Args: args[1:], Cwd: f.workdir, User: f.user, Env: p.env,
		Stdin: pp.inR, Stdout: pp.outW, Stderr: pp.errW, Control: pp.ctlR, Status: pp.statusW}
	sb, err := host.Create(ctx, opts)
	pp.closeSandboxEnds() // the agent has its own copies
	if err != nil {
		return err
	}
	timedOut, done := aroundRun(ctx, host, sb, p.timeout, stderr)
	defer done()

	maxOut := int64(p.maxOut)
	if maxOut <= 0 {
		maxOut = agent.DefaultMaxOutput
	}
	out := &cappedOutput{room: maxOut}
	var broken atomic.Bool             // a write to stdout or stderr failed with EPIPE
	var writeErr atomic.Pointer[error] // or otherwise
	var pumps sync.WaitGroup
	for _, c := range []struct {
		w io.Writer
		r *os.File
	}{{stdout, pp.outR}, {stderr, pp.errR}} {
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			if err := out.copy(c.w, c.r); err != nil {
				// As on the usual path: cage stops, and so does the
				// command, which would block on a pipe no one reads.
				if errors.Is(err, syscall.EPIPE) {
					broken.Store(true)
				} else {
					writeErr.CompareAndSwap(nil, &err)
				}
				_ = sb.Destroy()
			}
		}()
	}
	go func() {
		// Ends with stdin, or when the command no longer reads it (EPIPE).
		_, _ = io.Copy(pp.inW, os.Stdin)
		pp.inW.Close()
	}()
	var interrupted atomic.Bool
	gaveUp := make(chan struct{}) // closed at the second signal
	var giveUp sync.Once
	stop := forwardSignalsOnce(pp.ctlW, func() {
		interrupted.Store(true)
		_ = sb.Destroy()
		giveUp.Do(func() { close(gaveUp) })
	})
	defer stop()

	trace.Mark("run")
	end, err := readOneShotEnd(pp.statusR)
	trace.Mark("ended")
	// The agent exits after its report, and every process of the sandbox
	// with it: the pipes then end. Past a second (a consumer of stdout
	// slower than that), destroying it makes sure. What is left in the
	// pipes is still copied out, however slowly it is read, unless a
	// second signal says to stop or the timeout has fired: a consumer
	// that never reads must not keep cage from ending.
	drained := make(chan struct{})
	go func() { pumps.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-gaveUp:
	case <-time.After(time.Second):
		_ = sb.Destroy()
		select {
		case <-drained:
		case <-gaveUp:
		case <-timedOut.expired:
			// Past the timeout, which bounds the whole run: a second
			// more for a slow reader, then no longer.
			select {
			case <-drained:
			case <-gaveUp:
			case <-time.After(time.Second):
			}
		}
	}
	switch {
	case broken.Load():
		return &exitError{code: 128 + int(syscall.SIGPIPE)}
	case writeErr.Load() != nil:
		return exitf(ExitInternal, "writing the command's output: %v", *writeErr.Load())
	case interrupted.Load():
		return exitf(130, "interrupted; the sandbox was destroyed")
	case err != nil:
		return sandboxFailure(sb, timedOut, p.timeout, err)
	case end.Refused != "":
		var code connect.Code
		if code.UnmarshalText([]byte(end.Refused)) != nil {
			code = connect.CodeUnknown
		}
		if e := commandRefused(connect.NewError(code, errors.New(end.Message))); e != nil {
			return e
		}
		return exitf(ExitInternal, "%s", end.Message)
	}
	return exitFromEnd(&pb.ProcessEvent_EndEvent{Exited: end.Exited, ExitCode: end.ExitCode, Status: end.Status,
		Reason: end.Reason, Truncated: out.truncated.Load()}, args[0], p.opts.Memory, p.opts.Pids, stderr)
}

// readOneShotEnd reads the agent's report: one bounded JSON line. Nothing
// (the agent died first) is an error.
func readOneShotEnd(r io.Reader) (*agent.OneShotEnd, error) {
	line, err := bufio.NewReaderSize(io.LimitReader(r, agent.MaxOneShotEnd), agent.MaxOneShotEnd).ReadSlice('\n')
	if err != nil {
		return nil, fmt.Errorf("the sandbox's agent ended without a report: %w", err)
	}
	end := &agent.OneShotEnd{}
	if err := json.Unmarshal(line, end); err != nil {
		return nil, fmt.Errorf("the sandbox's agent's report: %w", err)
	}
	return end, nil
}

// oneShotPipes are a one-shot run's five pipes: this process's ends and
// the sandbox's.
type oneShotPipes struct {
	inR, inW, outR, outW, errR, errW, ctlR, ctlW, statusR, statusW *os.File
}

func newOneShotPipes() (*oneShotPipes, error) {
	pp := &oneShotPipes{}
	for _, ends := range [][2]**os.File{{&pp.inR, &pp.inW}, {&pp.outR, &pp.outW}, {&pp.errR, &pp.errW},
		{&pp.ctlR, &pp.ctlW}, {&pp.statusR, &pp.statusW}} {
		r, w, err := os.Pipe()
		if err != nil {
			pp.close()
			return nil, err
		}
		*ends[0], *ends[1] = r, w
	}
	return pp, nil
}

// closeSandboxEnds closes this process's copies of the sandbox's ends:
// then each pipe ends when the sandbox's processes are gone.
func (pp *oneShotPipes) closeSandboxEnds() {
	for _, f := range []*os.File{pp.inR, pp.outW, pp.errW, pp.ctlR, pp.statusW} {
		if f != nil {
			f.Close()
		}
	}
}

func (pp *oneShotPipes) close() {
	for _, f := range []*os.File{pp.inR, pp.inW, pp.outR, pp.outW, pp.errR, pp.errW, pp.ctlR, pp.ctlW, pp.statusR, pp.statusW} {
		if f != nil {
			f.Close() // twice is harmless: os.File says so
		}
	}
}

// cappedOutput forwards at most room bytes of a command's output, stdout
// and stderr together (the agent's cap on the usual path); past it, the
// rest is read and dropped, so that the command never blocks on a full
// pipe.
type cappedOutput struct {
	mu        sync.Mutex
	room      int64
	truncated atomic.Bool
}

func (c *cappedOutput) copy(w io.Writer, r io.Reader) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			c.mu.Lock()
			keep := min(int64(n), c.room)
			c.room -= keep
			c.mu.Unlock()
			if keep < int64(n) {
				c.truncated.Store(true)
			}
			if keep > 0 {
				if _, err := w.Write(buf[:keep]); err != nil {
					return err
				}
			}
		}
		if err != nil {
			return nil
		}
	}
}

// forwardSignalsOnce passes the first SIGINT/SIGTERM/SIGHUP to the command
// as SIGTERM, through the agent's control pipe; a second one calls second.
func forwardSignalsOnce(control *os.File, second func()) func() {
	return onInterrupts(func() bool {
		_, _ = control.Write([]byte{byte(syscall.SIGTERM)})
		return true
	}, second)
}
