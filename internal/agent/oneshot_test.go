package agent

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// oneShotRun is a one-shot run's host side in a test: the pipes, what the
// command wrote, and the agent's report.
type oneShotRun struct {
	stdinW, ctlW   *os.File
	stdout, stderr chan string
	statusRaw      chan string
	runErr         chan error
}

func oneShotServer(tb testing.TB) *Server {
	tb.Helper()
	dir, passwd := localUser(tb)
	s, err := New(Config{Root: dir, Passwd: passwd, Group: passwd, OneShot: true})
	if err != nil {
		tb.Fatal(err)
	}
	s.Configure("", map[string]string{"SANDBOX_WIDE": "yes"}, 0)
	return s
}

// startOneShot runs o's command in s as the agent would, on fresh pipes.
func startOneShot(tb testing.TB, s *Server, o OneShot) *oneShotRun {
	tb.Helper()
	pipe := func() (*os.File, *os.File) {
		r, w, err := os.Pipe()
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { r.Close(); w.Close() })
		return r, w
	}
	inR, inW := pipe()
	outR, outW := pipe()
	errR, errW := pipe()
	ctlR, ctlW := pipe()
	stR, stW := pipe()
	o.Stdin, o.Stdout, o.Stderr, o.Control, o.Status = inR, outW, errW, ctlR, stW
	r := &oneShotRun{stdinW: inW, ctlW: ctlW, stdout: make(chan string, 1), stderr: make(chan string, 1),
		statusRaw: make(chan string, 1), runErr: make(chan error, 1)}
	read := func(f *os.File, ch chan string) {
		b, _ := io.ReadAll(f)
		ch <- string(b)
	}
	go func() { r.runErr <- s.RunOnce(o) }()
	go read(outR, r.stdout)
	go read(errR, r.stderr)
	go read(stR, r.statusRaw)
	return r
}

// wait returns the output and the report, once the command has ended.
func (r *oneShotRun) wait(tb testing.TB) (stdout, stderr string, end OneShotEnd) {
	tb.Helper()
	select {
	case err := <-r.runErr:
		if err != nil {
			tb.Fatalf("RunOnce: %v", err)
		}
	case <-time.After(30 * time.Second):
		tb.Fatal("the one-shot command did not end")
	}
	raw := <-r.statusRaw
	if !strings.HasSuffix(raw, "\n") || strings.Count(raw, "\n") != 1 {
		tb.Fatalf("the report is not one line: %q", raw)
	}
	if err := json.Unmarshal([]byte(raw), &end); err != nil {
		tb.Fatalf("report %q: %v", raw, err)
	}
	return <-r.stdout, <-r.stderr, end
}

// TestRunOnce: the command runs on the host's pipes with the sandbox's
// environment and its own, in the user's home, and the report says how it
// ended; the agent keeps no copy of the command's pipes (their ends come
// when the command's processes are gone).
func TestRunOnce(t *testing.T) {
	s := oneShotServer(t)
	r := startOneShot(t, s, OneShot{Cmd: "sh", Args: []string{"-c", `read line; echo "out:$line:$SANDBOX_WIDE:$OWN:$(pwd)"; echo err >&2; exit 7`},
		Env: map[string]string{"OWN": "mine"}})
	if _, err := r.stdinW.Write([]byte("given\n")); err != nil {
		t.Fatal(err)
	}
	r.stdinW.Close()
	stdout, stderr, end := r.wait(t)
	home := filepath.Join(filepath.Dir(s.cfg.Passwd), "home")
	if want := "out:given:yes:mine:" + home + "\n"; stdout != want {
		t.Errorf("stdout %q, want %q", stdout, want)
	}
	if stderr != "err\n" {
		t.Errorf("stderr %q", stderr)
	}
	if !end.Exited || end.ExitCode != 7 || end.Reason != "exited" || end.Refused != "" {
		t.Errorf("report %+v, want an exit with 7", end)
	}
}

// TestRunOnceRefused: a command that cannot start is reported as the RPC
// path reports it (Connect's code), and its pipes are closed.
func TestRunOnceRefused(t *testing.T) {
	s := oneShotServer(t)
	for _, c := range []struct {
		o    OneShot
		code string
	}{
		{OneShot{Cmd: "no-such-command-here"}, "not_found"},
		{OneShot{Cmd: "/etc/passwd"}, "permission_denied"},
		{OneShot{Cmd: "true", User: "nobody-such"}, "invalid_argument"},
		{OneShot{Cmd: "true", Cwd: "/no/such/dir"}, "invalid_argument"},
	} {
		r := startOneShot(t, s, c.o)
		stdout, stderr, end := r.wait(t)
		if end.Refused != c.code || end.Message == "" || end.Exited {
			t.Errorf("%+v: report %+v, want refused %s with a message", c.o, end, c.code)
		}
		if stdout != "" || stderr != "" {
			t.Errorf("%+v: output %q %q", c.o, stdout, stderr)
		}
	}
}

// TestRunOnceSignals: a byte on the control pipe is a signal for the
// command (read once it runs); the report says it died of it. A number
// that is no signal is ignored.
func TestRunOnceSignals(t *testing.T) {
	s := oneShotServer(t)
	r := startOneShot(t, s, OneShot{Cmd: "sleep", Args: []string{"30"}})
	if _, err := r.ctlW.Write([]byte{0, 200, byte(syscall.SIGTERM)}); err != nil {
		t.Fatal(err)
	}
	_, _, end := r.wait(t)
	if end.Exited || end.Status != "signal: terminated" || end.Reason != "signal" {
		t.Errorf("report %+v, want death by SIGTERM", end)
	}
}

// TestRunOnceLongMessage: a refusal's message quotes the command, which
// may be long and all control bytes (six bytes each in JSON): the report
// still fits the host's bound, one line, and says not_found. Before (a
// review, 2026-12-03), a 4 KiB command name made a report the host could
// not read: cage run said "agent exited (status 0)", exit 125, not 127.
func TestRunOnceLongMessage(t *testing.T) {
	s := oneShotServer(t)
	for _, name := range []string{strings.Repeat("a", 5000), strings.Repeat("\x01", 5000), strings.Repeat("é", 3000)} {
		r := startOneShot(t, s, OneShot{Cmd: name})
		select {
		case err := <-r.runErr:
			if err != nil {
				t.Fatalf("RunOnce: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the one-shot command did not end")
		}
		raw := <-r.statusRaw
		if len(raw) > MaxOneShotEnd || strings.Count(raw, "\n") != 1 || !strings.HasSuffix(raw, "\n") {
			t.Fatalf("a %d-byte command name: a report of %d bytes (the host reads %d), %q...", len(name), len(raw), MaxOneShotEnd, raw[:min(len(raw), 80)])
		}
		var end OneShotEnd
		if err := json.Unmarshal([]byte(raw), &end); err != nil || end.Refused != "not_found" || !strings.HasSuffix(end.Message, "...") {
			t.Errorf("a %d-byte command name: report %.100q (%v), want not_found with the message cut", len(name), raw, err)
		}
	}
}
