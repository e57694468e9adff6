package agentclient

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
)

// RunOptions describes one command.
type RunOptions struct {
	Cmd  string
	Args []string
	Env  map[string]string
	Cwd  string
	User string // empty: the sandbox's default user

	// Stdin, when set, is copied to the process until EOF, then closed.
	Stdin          io.Reader
	Stdout, Stderr io.Writer // PTY output goes to Stdout

	PTY       *pb.PTY_Size // run in a PTY of this size
	TimeoutMs uint32
	// MaxOutput, when set, is asked of the agent and enforced here too:
	// past it (stdout, stderr and a PTY's output together) the rest is
	// dropped and the end event says truncated. The agent is inside the
	// wall, and its word was the only bound.
	MaxOutput uint64

	// OnStart is called with the process's pid once it runs.
	OnStart func(pid uint32)
}

// UserHeader is how envd learns the acting user: HTTP Basic with an empty password.
func UserHeader(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// Run starts a command, streams its output and input, and returns how it
// ended. An error means it could not start or the stream broke.
func (c *Client) Run(ctx context.Context, o RunOptions) (*pb.ProcessEvent_EndEvent, error) {
	cfg := &pb.ProcessConfig{Cmd: o.Cmd, Args: o.Args, Envs: o.Env}
	if o.Cwd != "" {
		cfg.Cwd = &o.Cwd
	}
	withStdin := o.Stdin != nil
	msg := &pb.StartRequest{Process: cfg, Stdin: &withStdin, TimeoutMs: o.TimeoutMs, MaxOutputBytes: o.MaxOutput}
	if o.PTY != nil {
		msg.Pty = &pb.PTY{Size: o.PTY}
	}
	req := connect.NewRequest(msg)
	if o.User != "" {
		req.Header().Set("Authorization", UserHeader(o.User))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.Process.Start(ctx, req)
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	started := false
	left, cut := o.MaxOutput, false
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch e := ev.GetEvent().(type) {
		case *pb.ProcessEvent_Start:
			// One start a stream: the agent is not trusted, and each would
			// start another feeder of the same input.
			if started {
				return nil, errors.New("the agent started the process twice")
			}
			started = true
			if o.OnStart != nil {
				o.OnStart(e.Start.GetPid())
			}
			if withStdin {
				go c.feed(ctx, e.Start.GetPid(), o.Stdin, o.PTY != nil)
			}
		case *pb.ProcessEvent_Data:
			if o.MaxOutput > 0 {
				var dropped bool
				if left, dropped = capData(e.Data, left); dropped {
					cut = true
				}
			}
			if err := writeData(e.Data, o.Stdout, o.Stderr); err != nil {
				return nil, err
			}
		case *pb.ProcessEvent_End:
			if cut {
				e.End.Truncated = true
			}
			return e.End, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("the agent closed the stream before the process ended")
}

// capData cuts d's bytes to left, and says what is left after them and
// whether any were dropped.
func capData(d *pb.ProcessEvent_DataEvent, left uint64) (uint64, bool) {
	var b *[]byte
	switch out := d.GetOutput().(type) {
	case *pb.ProcessEvent_DataEvent_Stdout:
		b = &out.Stdout
	case *pb.ProcessEvent_DataEvent_Stderr:
		b = &out.Stderr
	case *pb.ProcessEvent_DataEvent_Pty:
		b = &out.Pty
	default:
		return left, false
	}
	if uint64(len(*b)) <= left {
		return left - uint64(len(*b)), false
	}
	*b = (*b)[:left]
	return 0, true
}

func writeData(d *pb.ProcessEvent_DataEvent, stdout, stderr io.Writer) error {
	var w io.Writer
	var b []byte
	switch {
	case d.GetStdout() != nil:
		w, b = stdout, d.GetStdout()
	case d.GetStderr() != nil:
		w, b = stderr, d.GetStderr()
	case d.GetPty() != nil:
		w, b = stdout, d.GetPty()
	}
	if w == nil || len(b) == 0 {
		return nil
	}
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	return nil
}

// feed copies r to the process's stdin (or PTY) and closes stdin at EOF.
// At the end of input into a PTY, the terminal's end-of-file character
// (Ctrl-D) is sent, twice when the last line is unfinished, as typing it
// would.
func (c *Client) feed(ctx context.Context, pid uint32, r io.Reader, pty bool) {
	sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}}
	buf := make([]byte, 32<<10)
	var last byte = '\n'
	for {
		n, err := r.Read(buf)
		if n > 0 {
			last = buf[n-1]
			in := &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: append([]byte(nil), buf[:n]...)}}
			if pty {
				in.Input = &pb.ProcessInput_Pty{Pty: append([]byte(nil), buf[:n]...)}
			}
			if _, serr := c.Process.SendInput(ctx, connect.NewRequest(&pb.SendInputRequest{Process: sel, Input: in})); serr != nil {
				return
			}
		}
		if err != nil {
			if !pty {
				_, _ = c.Process.CloseStdin(ctx, connect.NewRequest(&pb.CloseStdinRequest{Process: sel}))
				return
			}
			eof := []byte{4}
			if last != '\n' {
				eof = []byte{4, 4}
			}
			in := &pb.ProcessInput{Input: &pb.ProcessInput_Pty{Pty: eof}}
			_, _ = c.Process.SendInput(ctx, connect.NewRequest(&pb.SendInputRequest{Process: sel, Input: in}))
			return
		}
	}
}
