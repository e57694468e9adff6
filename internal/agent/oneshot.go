package agent

import (
	"encoding/json"
	"os"
	"syscall"
	"unicode/utf8"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
)

// OneShot is the one command a sandbox was made for (cage run's one-shot
// path): the agent starts it on the host's pipes as soon as the sandbox
// is sealed and started, with no request and no server, and reports how
// it ended. Output goes straight to the host's pipes: nothing is copied
// through the agent.
type OneShot struct {
	Cmd  string
	Args []string
	Cwd  string
	User string // "" is the default user
	Env  map[string]string
	// Stdin, Stdout, Stderr are the command's; RunOnce closes its copies
	// once the command has them.
	Stdin, Stdout, Stderr *os.File
	// Control carries the host's signals for the command, one byte each
	// (the signal's number); its end (the host gone) changes nothing.
	Control *os.File
	// Status gets one OneShotEnd line.
	Status *os.File
}

// OneShotEnd is how a one-shot command ended, as the agent reports it. The
// host takes it as the agent's word, no more: it explains an exit, never
// enforces a limit.
type OneShotEnd struct {
	// Refused is Connect's code for a command that did not start
	// (not_found, permission_denied, invalid_argument,
	// resource_exhausted, internal), with Message; empty when it ran.
	Refused string `json:"refused,omitempty"`
	Message string `json:"message,omitempty"`
	// How it ended, as process.ProcessEvent.EndEvent says it.
	Exited   bool   `json:"exited,omitempty"`
	ExitCode int32  `json:"exit_code"`
	Status   string `json:"status,omitempty"`
	Reason   string `json:"reason,omitempty"`
}

// MaxOneShotEnd bounds what the host reads of a OneShotEnd.
const MaxOneShotEnd = 4 << 10

// maxOneShotMessage bounds a OneShotEnd's Message, so that its line fits
// in MaxOneShotEnd whatever it holds: JSON writes a byte as at most six
// (\u00XX), and the other fields are short.
const maxOneShotMessage = 512

// RunOnce runs o's command to its end and writes how it ended to
// o.Status. The sandbox-wide environment is Configure's. An error is the
// status pipe's: the host then learns nothing from the agent.
func (s *Server) RunOnce(o OneShot) error {
	// sudo is served as Serve serves it, and bound before the command
	// exists: else the command could squat @cage/sudo and answer its own
	// (or a root process's) sudo requests.
	s.startSudo()
	s.ReserveThreads()
	stdio := []*os.File{o.Stdin, o.Stdout, o.Stderr}
	end := OneShotEnd{}
	user := s.cfg.DefaultUser
	if o.User != "" {
		user = o.User
	}
	var p *proc
	u, err := s.lookupUser(user)
	if err == nil {
		cfg := &pb.ProcessConfig{Cmd: o.Cmd, Args: o.Args, Envs: o.Env}
		if o.Cwd != "" {
			cfg.Cwd = &o.Cwd
		}
		p, _, err = s.procs.startOn(&pb.StartRequest{Process: cfg}, u, stdio)
	}
	if err != nil {
		for _, f := range stdio {
			f.Close()
		}
		end.Refused, end.Message = connect.CodeOf(err).String(), shorten(connectMessage(err), maxOneShotMessage)
	} else {
		go forwardSignals(o.Control, p)
		<-p.done
		e := p.end.GetEnd()
		end.Exited, end.ExitCode, end.Status, end.Reason = e.GetExited(), e.GetExitCode(), e.GetStatus(), e.GetReason()
	}
	line, _ := json.Marshal(&end)
	_, err = o.Status.Write(append(line, '\n'))
	o.Status.Close()
	return err
}

// forwardSignals sends the command each signal the host asks for.
func forwardSignals(control *os.File, p *proc) {
	buf := make([]byte, 16)
	for {
		n, err := control.Read(buf)
		for _, b := range buf[:n] {
			if b > 0 && b < 65 {
				_ = p.signal(syscall.Signal(b))
			}
		}
		if err != nil {
			return
		}
	}
}

// shorten cuts s to at most n bytes, at a rune's start, marked with "...".
func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - len("...")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

func connectMessage(err error) string {
	if ce, ok := err.(*connect.Error); ok {
		return ce.Message()
	}
	return err.Error()
}
