package mcp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
)

// agentOutputCap is what the agent forwards of one command's output (both
// streams together); the tool keeps only the head and tail of that.
const agentOutputCap = 16 << 20

type execIn struct {
	SandboxID      string            `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	Command        string            `json:"command" jsonschema:"a shell command line, run by bash -l -c (sh where the template has no bash)"`
	Cwd            string            `json:"cwd,omitempty" jsonschema:"working directory (default: the user's home)"`
	Envs           map[string]string `json:"envs,omitempty" jsonschema:"environment variables for this command"`
	User           string            `json:"user,omitempty" jsonschema:"account to run as, e.g. root (default: the sandbox's default user)"`
	TimeoutS       int64             `json:"timeout_s,omitempty" jsonschema:"kill the command (its whole process group) after this many seconds; default 60, and none for a background command"`
	Background     bool              `json:"background,omitempty" jsonschema:"start the command and return its pid at once; it runs on and its output is discarded (redirect it to a file to keep it)"`
	MaxOutputBytes int               `json:"max_output_bytes,omitempty" jsonschema:"bytes kept of stdout and of stderr each; beyond, the head and the tail are kept and truncated is set"`
}

var execSchema = lazySchema[execIn](func(p props) {
	p.sandboxID().minLen("command", 1).maxLen("command", maxCommandLen).maxLen("cwd", maxPathLen).
		maxProps("envs", maxEnvs).maxLen("user", 64).rng("timeout_s", 1, maxExecTimeout).
		def("max_output_bytes", defaultOutput).rng("max_output_bytes", minOutput, maxOutput)
})

type execOut struct {
	ExitCode    int32  `json:"exit_code" jsonschema:"the command's exit status (-1 when it did not exit by itself: see reason)"`
	Stdout      string `json:"stdout"`
	Stderr      string `json:"stderr"`
	Truncated   bool   `json:"truncated" jsonschema:"output was cut: the middle of a stream beyond max_output_bytes is left out (marked in the text)"`
	StdoutBytes int64  `json:"stdout_bytes" jsonschema:"bytes the command wrote to stdout"`
	StderrBytes int64  `json:"stderr_bytes" jsonschema:"bytes the command wrote to stderr"`
	Reason      string `json:"reason,omitempty" jsonschema:"how it ended: exited, signal, oom, timeout or pids_limit"`
	Error       string `json:"error,omitempty" jsonschema:"what went wrong, when something did"`
	DurationMs  int64  `json:"duration_ms"`
	Pid         uint32 `json:"pid,omitempty" jsonschema:"the process id of a background command"`
}

func (t *tools) exec(ctx context.Context, _ *sdk.CallToolRequest, in execIn) (*sdk.CallToolResult, execOut, error) {
	if err := checkExec(in); err != nil {
		return nil, execOut{}, err
	}
	sb, err := t.reach(ctx, in.SandboxID)
	if err != nil {
		return nil, execOut{}, err
	}
	defer sb.release()
	if in.Background {
		pid, err := t.startBackground(ctx, sb.agent, in)
		if err != nil {
			return nil, execOut{}, err
		}
		return nil, execOut{ExitCode: -1, Pid: pid, Reason: "running"}, nil
	}
	limit := in.MaxOutputBytes
	if limit == 0 {
		limit = defaultOutput
	}
	timeout := in.TimeoutS
	if timeout == 0 {
		timeout = defaultExecTimeout
	}
	stdout, stderr := newCapture(limit), newCapture(limit)
	start := time.Now()
	end, err := t.runShell(ctx, sb.agent, in, agentclient.RunOptions{Cwd: in.Cwd, Env: in.Envs, User: in.User,
		Stdout: stdout, Stderr: stderr, TimeoutMs: uint32(timeout * 1000), MaxOutput: agentOutputCap})
	if err != nil {
		return nil, execOut{}, t.failure(err)
	}
	return nil, execAnswer(end, stdout, stderr, timeout, time.Since(start)), nil
}

// maxEndReason and maxEndError bound what an answer repeats of the agent's own words in
// its end event: the reason and the error.
const (
	maxEndReason = 64
	maxEndError  = 4 << 10
)

// endWords is the agent's text s, at most n bytes of valid UTF-8. The
// agent is inside the wall: its end event's strings were repeated whole,
// up to its 4 MiB message, past the answer's bounds (found by review,
// 2026-12-04).
func endWords(s string, n int) string {
	return strings.ToValidUTF8(clip(s, n), "\uFFFD")
}

// execAnswer is a finished command's answer.
func execAnswer(end *pb.ProcessEvent_EndEvent, stdout, stderr *capture, timeout int64, took time.Duration) execOut {
	out := execOut{ExitCode: end.GetExitCode(), Reason: endWords(end.GetReason(), maxEndReason), Error: endWords(end.GetError(), maxEndError),
		DurationMs: took.Milliseconds(), StdoutBytes: stdout.total, StderrBytes: stderr.total}
	var cut1, cut2 bool
	out.Stdout, cut1 = stdout.text("stdout")
	out.Stderr, cut2 = stderr.text("stderr")
	out.Truncated = cut1 || cut2 || end.GetTruncated()
	if !end.GetExited() && out.ExitCode == 0 {
		out.ExitCode = -1
	}
	if out.Reason == "timeout" && out.Error == "" {
		out.Error = fmt.Sprintf("killed after timeout_s=%d seconds", timeout)
	}
	if end.GetTruncated() {
		out.Error = strings.TrimSpace(out.Error + fmt.Sprintf(" (the agent stopped forwarding output after %d MiB)", agentOutputCap>>20))
	}
	return out
}

func checkExec(in execIn) error {
	if err := checkID(in.SandboxID); err != nil {
		return err
	}
	switch {
	case strings.TrimSpace(in.Command) == "":
		return errors.New("command is empty")
	case len(in.Command) > maxCommandLen:
		return fmt.Errorf("command is %d bytes, over %d: write it to a file with file_write and run that", len(in.Command), maxCommandLen)
	case strings.ContainsRune(in.Command, 0):
		return errors.New("command contains a NUL byte")
	case in.TimeoutS < 0 || in.TimeoutS > maxExecTimeout:
		return fmt.Errorf("timeout_s %d: want 1 to %d", in.TimeoutS, maxExecTimeout)
	case in.MaxOutputBytes != 0 && (in.MaxOutputBytes < minOutput || in.MaxOutputBytes > maxOutput):
		return fmt.Errorf("max_output_bytes %d: want %d to %d", in.MaxOutputBytes, minOutput, maxOutput)
	}
	if in.Cwd != "" {
		if err := checkPath("cwd", in.Cwd); err != nil {
			return err
		}
	}
	return checkEnvs(in.Envs)
}

// runShell runs the command line through bash -l -c, as E2B's SDKs do, or
// sh -c where the template has no bash. The agent is asked to end it
// after o.TimeoutMs; the host stops waiting agentGrace later whatever the
// agent does (it is inside the wall: one that never ended the stream held
// the call, a daemon goroutine and one of the key's /mcp requests for as
// long as the MCP client waited; found by review, 2026-12-05).
func (t *tools) runShell(ctx context.Context, ac *agentclient.Client, in execIn, o agentclient.RunOptions) (*pb.ProcessEvent_EndEvent, error) {
	rctx, cancel := context.WithCancel(ctx)
	if o.TimeoutMs > 0 {
		rctx, cancel = context.WithTimeout(ctx, time.Duration(o.TimeoutMs)*time.Millisecond+agentGrace)
	}
	defer cancel()
	o.Cmd, o.Args = "/bin/bash", []string{"-l", "-c", in.Command}
	end, err := ac.Run(rctx, o)
	if noBash(err) {
		o.Cmd, o.Args = "/bin/sh", []string{"-c", in.Command}
		end, err = ac.Run(rctx, o)
	}
	if err != nil && rctx.Err() != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("the sandbox's agent did not end the command within timeout_s=%d (and %v more): it stopped answering",
			o.TimeoutMs/1000, agentGrace)
	}
	return end, err
}

// agentGrace is how long past a command's timeout the host waits for the
// agent to end it (a variable for the tests).
var agentGrace = 5 * time.Second

// startWithin bounds the wait for the agent to say a background command
// started (a variable for the tests).
var startWithin = 30 * time.Second

// noBash says whether a start failed because the template has no bash.
func noBash(err error) bool {
	var ce *connect.Error
	return errors.As(err, &ce) && ce.Code() == connect.CodeNotFound && strings.HasPrefix(ce.Message(), "/bin/bash:")
}

// startBackground starts the command and leaves once the agent says it
// runs: the agent keeps a process whose client went away.
func (t *tools) startBackground(ctx context.Context, ac *agentclient.Client, in execIn) (uint32, error) {
	for _, shell := range [][]string{{"/bin/bash", "-l", "-c"}, {"/bin/sh", "-c"}} {
		cfg := &pb.ProcessConfig{Cmd: shell[0], Args: append(shell[1:], in.Command), Envs: in.Envs}
		if in.Cwd != "" {
			cfg.Cwd = &in.Cwd
		}
		msg := &pb.StartRequest{Process: cfg, TimeoutMs: uint32(in.TimeoutS * 1000)}
		req := connect.NewRequest(msg)
		if in.User != "" {
			req.Header().Set("Authorization", agentclient.UserHeader(in.User))
		}
		// The agent says it started, or why not, at once; one that sends
		// anything else (output, without end) is not waited for longer
		// than startWithin.
		sctx, cancel := context.WithTimeout(ctx, startWithin)
		stream, err := ac.Process.Start(sctx, req)
		if err != nil {
			cancel()
			if noBash(err) {
				continue
			}
			return 0, t.failure(err)
		}
		var pid uint32
		var end *pb.ProcessEvent_EndEvent
		for pid == 0 && end == nil && stream.Receive() {
			switch e := stream.Msg().GetEvent().GetEvent().(type) {
			case *pb.ProcessEvent_Start:
				pid = e.Start.GetPid()
			case *pb.ProcessEvent_End:
				end = e.End
			}
		}
		serr := stream.Err()
		cancel()
		stream.Close()
		switch {
		case pid != 0:
			return pid, nil
		case noBash(serr):
			continue
		case end != nil:
			return 0, fmt.Errorf("the command did not start: %s", endWords(end.GetError(), maxEndError))
		case serr != nil:
			return 0, t.failure(serr)
		}
		return 0, errors.New("the agent closed the stream before the command started")
	}
	return 0, errors.New("the template has neither /bin/bash nor /bin/sh")
}

// capture keeps a stream's output within limit bytes: all of it while it
// fits, else its head and its tail.
type capture struct {
	limit int
	buf   []byte // everything, while total <= limit
	head  []byte // past the limit: the first bytes
	tail  []byte // and the last ones (trimmed to limit/2 lazily)
	total int64
}

func newCapture(limit int) *capture { return &capture{limit: limit} }

func (c *capture) Write(p []byte) (int, error) {
	c.total += int64(len(p))
	if c.head == nil {
		if len(c.buf)+len(p) <= c.limit {
			c.buf = append(c.buf, p...)
			return len(p), nil
		}
		all := append(c.buf, p...)
		h := c.limit - c.limit/2
		c.head = append([]byte(nil), all[:h]...)
		c.tail = append([]byte(nil), all[h:]...)
		c.buf = nil
	} else {
		c.tail = append(c.tail, p...)
	}
	if t := c.limit / 2; len(c.tail) > 2*t {
		c.tail = append([]byte(nil), c.tail[len(c.tail)-t:]...)
	}
	return len(p), nil
}

// text is what was kept, as valid UTF-8, with a line in the middle that
// says how much was left out; cut says whether anything was.
func (c *capture) text(name string) (s string, cut bool) {
	if c.head == nil {
		return strings.ToValidUTF8(string(c.buf), "\uFFFD"), false
	}
	head, tail := c.head, c.tail
	if t := c.limit / 2; len(tail) > t {
		tail = tail[len(tail)-t:]
	}
	for i := len(head) - 1; i >= 0 && i >= len(head)-utf8.UTFMax; i-- { // a rune cut at the end
		if utf8.RuneStart(head[i]) {
			if !utf8.FullRune(head[i:]) {
				head = head[:i]
			}
			break
		}
	}
	for len(tail) > 0 && !utf8.RuneStart(tail[0]) {
		tail = tail[1:]
	}
	omitted := c.total - int64(len(head)) - int64(len(tail))
	note := fmt.Sprintf("\n[... cage: %d bytes of %s left out here: it wrote %d bytes, over max_output_bytes=%d; this is the head and the tail ...]\n",
		omitted, name, c.total, c.limit)
	return strings.ToValidUTF8(string(head), "\uFFFD") + note + strings.ToValidUTF8(string(tail), "\uFFFD"), true
}
