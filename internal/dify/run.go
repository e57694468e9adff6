package dify

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/units"
	"github.com/cagehq/cage/internal/wall"

	pb "github.com/cagehq/cage/api/gen/process"
)

// Result is a run's data in the envelope (dify-sandbox since it separated
// stderr from errors): error is empty when the code exited 0 (unless
// something went wrong around it, such as output cut at the bound), else
// "process exited with code N", the lines of what happened ("error:
// timeout") and the code's stderr.
type Result struct {
	Stdout   string `json:"stdout"`
	Stderr   string `json:"stderr"`
	Error    string `json:"error"`
	ExitCode int    `json:"exit_code"`

	outcome string // for the audit trail: ok, exit, timeout, oom, signal, pids, truncated
}

// commands run a language's code read from standard input.
var commands = map[string][]string{
	"python3": {"python3", "-"},
	"nodejs":  {"node", "-"},
}

// hostGrace is how long past the timeout the host waits for the agent to
// report the end it was asked to enforce, before it stops waiting (and
// destroys the sandbox either way).
const hostGrace = 2 * time.Second

// LifeMargin is what a run's sandbox may outlive its timeout by in the
// store: were the daemon to die mid-run, the next one would end it then.
const LifeMargin = 30 * time.Second

// execute runs a request in a fresh sandbox: a worker's turn (waiting for
// one), a create through the manager, the code on the interpreter's
// standard input, the sandbox killed afterwards (after the answer is
// written; the turn is given back only once it is gone).
func (s *Server) execute(ctx context.Context, req runRequest, client string) (*Result, error) {
	select {
	case s.workers <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	began := time.Now()
	policy := network.Policy{Mode: network.None}
	if req.EnableNetwork {
		policy = *s.cfg.Network
	}
	rec, err := s.sbx.Create(ctx, manager.CreateRequest{
		KeyID: KeyID, Wall: s.cfg.Wall, Template: s.cfg.Template, Timeout: s.cfg.Timeout + LifeMargin,
		Memory: s.cfg.Memory, CPUs: s.cfg.CPUs, Pids: s.cfg.Pids, Net: policy,
		Metadata: map[string]string{"dify": req.Language},
	})
	if err != nil {
		<-s.workers
		return nil, err
	}
	defer func() {
		go func() {
			if err := s.sbx.Kill(KeyID, rec.ID); err != nil {
				s.log.Warn("dify: kill a run's sandbox", "sandbox", rec.ID, "err", err)
			}
			<-s.workers
		}()
	}()
	sb, err := s.sbx.Ready(ctx, rec.ID, false)
	if err != nil {
		return nil, err
	}
	res, err := s.runIn(ctx, sb, req)
	if err != nil {
		return nil, err
	}
	s.record(rec.ID, req, res, policy.Mode, time.Since(began), client)
	return res, nil
}

// maxCodeKept bounds the code an audit entry keeps (its hash covers all).
const maxCodeKept = 4 << 10

// record puts a run in the audit trail (and the debug log).
func (s *Server) record(id string, req runRequest, res *Result, mode network.Mode, took time.Duration, client string) {
	sum := sha256.Sum256([]byte(req.Code))
	code := req.Code
	if len(code) > maxCodeKept {
		code = code[:maxCodeKept] + "…(truncated)"
	}
	d := map[string]any{"via": "dify", "language": req.Language, "code": code, "code_bytes": len(req.Code),
		"code_sha256": hex.EncodeToString(sum[:]), "exit_code": res.ExitCode, "outcome": res.outcome,
		"took_ms": took.Milliseconds(), "stdout_bytes": len(res.Stdout), "stderr_bytes": len(res.Stderr), "network": string(mode)}
	s.cfg.Audit.Record(audit.Event{Kind: audit.KindCodeRun, KeyID: KeyID, SandboxID: id, Route: "POST /v1/sandbox/run",
		Status: http.StatusOK, Client: client, Detail: d})
	s.log.Debug("dify: run", "sandbox", id, "language", req.Language, "outcome", res.outcome, "exit", res.ExitCode,
		"took", took, "client", client)
}

// runIn feeds the code to the language's interpreter in sb and waits for
// its end, at most the timeout (the agent is asked to enforce it; the host
// stops waiting hostGrace later whatever the agent does).
func (s *Server) runIn(ctx context.Context, sb wall.Sandbox, req runRequest) (*Result, error) {
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	rctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout+hostGrace)
	defer cancel()
	argv := commands[req.Language]
	stdout, stderr := &capped{max: s.cfg.MaxOutput}, &capped{max: s.cfg.MaxOutput}
	end, err := c.Run(rctx, agentclient.RunOptions{Cmd: argv[0], Args: argv[1:], Stdin: strings.NewReader(req.Code),
		Stdout: stdout, Stderr: stderr, TimeoutMs: uint32(s.cfg.Timeout / time.Millisecond),
		MaxOutput: uint64(2*s.cfg.MaxOutput + 1)})
	if ctx.Err() != nil {
		return nil, ctx.Err() // the caller went away
	}
	// Each stream is bounded as it is sent, escaped in JSON (a control
	// byte is 6 bytes there), not only as the code wrote it.
	out, cutOut := fitJSON(stdout.String(), s.cfg.MaxOutput)
	errOut, cutErr := fitJSON(stderr.String(), s.cfg.MaxOutput)
	res := &Result{Stdout: out, Stderr: errOut, outcome: "ok"}
	var lines []string
	switch {
	case err != nil && rctx.Err() != nil, end.GetReason() == "timeout":
		res.ExitCode, res.outcome = -1, "timeout"
		lines = append(lines, "error: timeout")
	case err != nil:
		// The stream broke: the agent is inside the wall and answers for
		// nothing; the sandbox goes anyway.
		res.ExitCode, res.outcome = -1, "broken"
		lines = append(lines, "error: the sandbox stopped answering")
	default:
		res.ExitCode = int(end.GetExitCode())
		lines = append(lines, s.endLines(end, res)...)
	}
	if stdout.dropped > 0 || stderr.dropped > 0 || cutOut || cutErr || end.GetTruncated() {
		lines = append(lines, fmt.Sprintf("error: output truncated at %s per stream", units.FormatSize(s.cfg.MaxOutput)))
		if res.outcome == "ok" {
			res.outcome = "truncated"
		}
	}
	// error repeats stderr (dify-sandbox's format) after a failure: only
	// its end, where a traceback ends, so that the answer holds at most
	// 2 × max_output and this much more.
	tail := stderr.String()
	if res.ExitCode != 0 {
		var cut bool
		if tail, cut = tailJSON(tail, min(maxErrorStderr, s.cfg.MaxOutput)); cut {
			lines = append(lines, fmt.Sprintf("error: stderr shortened to its last %s here", units.FormatSize(min(maxErrorStderr, s.cfg.MaxOutput))))
		}
	}
	res.Error = errorText(res.ExitCode, lines, tail)
	return res, nil
}

// maxErrorStderr bounds the copy of stderr in a failed run's error, as
// JSON (at most max_output).
const maxErrorStderr = 64 << 10

// jsonCost is how many bytes the rune r, of size bytes in the string,
// takes in encoding/json's output (HTML-escaped, as json.Marshal writes).
func jsonCost(r rune, size int) int64 {
	switch {
	case r == utf8.RuneError && size == 1:
		return 6 // \ufffd
	case r == '"' || r == '\\' || r == '\n' || r == '\r' || r == '\t':
		return 2
	case r < 0x20 || r == '<' || r == '>' || r == '&' || r == '\u2028' || r == '\u2029':
		return 6
	}
	return int64(size)
}

// fitJSON is the longest prefix of s, cut between runes, that takes at
// most max bytes in JSON (quotes aside), and whether it is shorter than s.
func fitJSON(s string, max int64) (string, bool) {
	var n int64
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if n += jsonCost(r, size); n > max {
			return s[:i], true
		}
		i += size
	}
	return s, false
}

// tailJSON is the longest suffix of s, cut between runes, that takes at
// most max bytes in JSON, and whether it is shorter than s.
func tailJSON(s string, max int64) (string, bool) {
	var n int64
	for i := len(s); i > 0; {
		r, size := utf8.DecodeLastRuneInString(s[:i])
		if n += jsonCost(r, size); n > max {
			return s[i:], true
		}
		i -= size
	}
	return s, false
}

// endLines explains how the process ended, from the agent's end event.
func (s *Server) endLines(end *pb.ProcessEvent_EndEvent, res *Result) []string {
	switch end.GetReason() {
	case "oom":
		res.outcome = "oom"
		return []string{fmt.Sprintf("error: killed: out of memory (the limit is %s)", units.FormatSize(s.cfg.Memory))}
	case "pids_limit":
		res.outcome = "pids"
		return []string{fmt.Sprintf("error: the process limit (%d) was reached", s.cfg.Pids)}
	case "signal":
		res.outcome = "signal"
		return []string{"error: killed by a signal (" + agentWords(end.GetStatus()) + ")"}
	case "start_failed":
		res.outcome = "start_failed"
		return []string{"error: the interpreter could not be started: " + agentWords(end.GetError())}
	}
	if res.ExitCode != 0 {
		res.outcome = "exit"
	}
	return nil
}

// maxAgentWords bounds, as JSON, what the answer repeats of the agent's
// own words in its end event (why a start failed, the signal).
const maxAgentWords = 1 << 10

// agentWords is the agent's text s held to maxAgentWords as JSON: the
// agent is inside the wall, and its end event's strings were repeated
// whole, up to its 4 MiB message, some 24 MiB escaped (found by review,
// 2026-12-04), past the answer's bound of twice max_output and 64 KiB.
func agentWords(s string) string {
	if head, cut := fitJSON(s, maxAgentWords); cut {
		return head + "..."
	}
	return s
}

// errorText is dify-sandbox's error field: the lines alone when the code
// exited 0, else "process exited with code N", the lines and stderr.
func errorText(exit int, lines []string, stderr string) string {
	var b strings.Builder
	if exit != 0 {
		fmt.Fprintf(&b, "process exited with code %d\n", exit)
	}
	for _, l := range lines {
		b.WriteString(l + "\n")
	}
	if exit != 0 {
		b.WriteString(stderr)
	}
	return b.String()
}

// capped keeps the first max bytes written to it and counts the rest.
type capped struct {
	buf     bytes.Buffer
	max     int64
	dropped int64
}

func (c *capped) Write(p []byte) (int, error) {
	n := len(p)
	room := c.max - int64(c.buf.Len())
	if room < int64(len(p)) {
		c.dropped += int64(len(p)) - max(room, 0)
		p = p[:max(room, 0)]
	}
	c.buf.Write(p)
	return n, nil
}

func (c *capped) String() string { return c.buf.String() }
