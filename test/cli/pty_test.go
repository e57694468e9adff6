package clitest

import (
	"bytes"
	"context"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// ptyRun is cage started on a terminal: its stdin and stdout are the slave
// of a fresh pseudo-terminal, its stderr is kept apart.
type ptyRun struct {
	e      *env
	master *os.File
	wait   func() int
	stderr *bytes.Buffer

	mu      sync.Mutex
	out     bytes.Buffer
	outDone chan struct{}
}

func (e *env) startOnPTY(rows, cols uint16, args ...string) *ptyRun {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cmd := e.command(ctx, args...)
	p := &ptyRun{e: e, stderr: &bytes.Buffer{}, outDone: make(chan struct{})}
	cmd.Stderr = p.stderr
	// The size is set on the master before cage starts, as a terminal
	// emulator does; pty.StartWithSize makes cage a session leader with the
	// terminal as its controlling one.
	master, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: rows, Cols: cols})
	if err != nil {
		cancel()
		e.t.Fatalf("start cage on a pty: %v", err)
	}
	p.master = master
	go func() {
		defer close(p.outDone)
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			p.mu.Lock()
			p.out.Write(buf[:n])
			p.mu.Unlock()
			if err != nil {
				return // EIO once cage, the last holder of the slave, is gone
			}
		}
	}()
	p.wait = func() int {
		defer cancel()
		err := cmd.Wait()
		select {
		case <-p.outDone:
		case <-time.After(10 * time.Second):
			e.t.Errorf("the terminal's output did not end after cage exited")
		}
		master.Close()
		return exitCodeOf(e.t, err)
	}
	e.t.Cleanup(func() { master.Close() })
	return p
}

func (p *ptyRun) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// waitFor waits until the terminal shows s.
func (p *ptyRun) waitFor(s string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if strings.Contains(p.output(), s) {
			return true
		}
		select {
		case <-p.outDone:
			return strings.Contains(p.output(), s)
		case <-time.After(10 * time.Millisecond):
		}
	}
	return false
}

func TestTerminal(t *testing.T) {
	e := setup(t)
	p := e.startOnPTY(40, 120, "run", "--", "bash", "-c", "test -t 0 && echo TTY-YES; stty size")
	code := p.wait()
	out := p.output()
	t.Logf("on a terminal: exit %d, terminal %q, stderr %q", code, out, p.stderr.String())
	if code != 0 || !strings.Contains(out, "TTY-YES") || !strings.Contains(out, "40 120") {
		t.Errorf("on a terminal: exit %d, terminal %q; want exit 0, TTY-YES and \"40 120\"", code, out)
	}
	if p.stderr.Len() != 0 {
		t.Errorf("on a terminal: cage's stderr %q, want none", p.stderr.String())
	}
	noPanic(t, p.stderr.String())

	// The exit code passes through in PTY mode too.
	p = e.startOnPTY(24, 80, "run", "--", "sh", "-c", "exit 3")
	if code := p.wait(); code != 3 {
		t.Errorf("exit 3 on a terminal: exit %d, terminal %q", code, p.output())
	}

	// A terminal that is not wanted.
	p = e.startOnPTY(40, 120, "run", "--tty", "never", "--", "sh", "-c",
		"if test -t 0; then echo IN-TTY; else echo IN-NOTTY; fi; if test -t 1; then echo OUT-TTY; else echo OUT-NOTTY; fi")
	code = p.wait()
	out = p.output()
	t.Logf("--tty never: exit %d, terminal %q, stderr %q", code, out, p.stderr.String())
	if code != 0 || !strings.Contains(out, "IN-NOTTY") || !strings.Contains(out, "OUT-NOTTY") || strings.Contains(out, "-TTY") {
		t.Errorf("--tty never on a terminal: exit %d, terminal %q; want exit 0 and no tty inside", code, out)
	}
	noPanic(t, p.stderr.String())
	e.noLeftovers()
}

func TestTerminalResize(t *testing.T) {
	e := setup(t)
	p := e.startOnPTY(40, 120, "run", "--timeout", "30s", "--", "bash", "-c",
		`echo READY; for i in $(seq 400); do if [ "$(stty size)" = "50 132" ]; then echo RESIZED; exit 0; fi; sleep 0.05; done; echo STILL $(stty size); exit 1`)
	if !p.waitFor("READY", 30*time.Second) {
		p.wait()
		t.Fatalf("never saw READY on the terminal: %q", p.output())
	}
	// The kernel sends SIGWINCH to cage, which resizes the sandbox's PTY.
	if err := pty.Setsize(p.master, &pty.Winsize{Rows: 50, Cols: 132}); err != nil {
		t.Fatal(err)
	}
	code := p.wait()
	out := p.output()
	t.Logf("resize: exit %d, terminal %q, stderr %q", code, out, p.stderr.String())
	if code != 0 || !strings.Contains(out, "RESIZED") {
		t.Errorf("the sandbox's terminal did not follow a resize to 50x132: exit %d, terminal %q", code, out)
	}
	noPanic(t, p.stderr.String())
	e.noLeftovers()
}

// Ctrl-C typed on the terminal reaches the command as a byte: the sandbox's
// PTY turns it into SIGINT for the command, not for cage.
func TestTerminalCtrlC(t *testing.T) {
	e := setup(t)
	p := e.startOnPTY(24, 80, "run", "--", "bash", "-c", `trap "echo got-int; exit 9" INT; echo READY; sleep 30 & wait`)
	if !p.waitFor("READY", 30*time.Second) {
		p.wait()
		t.Fatalf("never saw READY on the terminal: %q", p.output())
	}
	if _, err := io.WriteString(p.master, "\x03"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	code := p.wait()
	out := p.output()
	t.Logf("Ctrl-C: exit %d after %v, terminal %q, stderr %q", code, time.Since(start).Round(time.Millisecond), out, p.stderr.String())
	if code != 9 || !strings.Contains(out, "got-int") {
		t.Errorf("Ctrl-C on the terminal: exit %d, terminal %q; want the command to get SIGINT (got-int, exit 9)", code, out)
	}
	noPanic(t, p.stderr.String())
	e.noLeftovers()
}

// TestTerminalLeftCooked: `cage run` on a terminal makes it raw while the
// command runs; however the run ends it is cooked again (echo, lines)
// when cage exits: at its timeout (the sandbox destroyed under a command
// that never ends), and at a SIGTERM from outside, then a second (before,
// the timeout's way out returned without undoing it, and a SIGTERM ended
// cage at once: either way the caller's shell was left echoing nothing).
func TestTerminalLeftCooked(t *testing.T) {
	e := setup(t)
	for _, c := range []struct {
		name    string
		args    []string
		signals int
	}{
		{"timeout", []string{"run", "--timeout", "2s", "--", "bash", "-c", "echo READY; sleep 100"}, 0},
		{"SIGTERM twice", []string{"run", "--timeout", "60s", "--", "bash", "-c", "trap '' TERM; echo READY; sleep 100"}, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			master, tty, err := pty.Open()
			if err != nil {
				t.Fatal(err)
			}
			defer master.Close()
			defer tty.Close() // held here too, to read its settings once cage is gone
			before, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := e.command(ctx, c.args...)
			var stderr bytes.Buffer
			cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, &stderr
			cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var out bytes.Buffer
			go func() {
				buf := make([]byte, 4096)
				for {
					n, err := master.Read(buf)
					mu.Lock()
					out.Write(buf[:n])
					mu.Unlock()
					if err != nil {
						return
					}
				}
			}()
			deadline := time.Now().Add(30 * time.Second)
			for {
				mu.Lock()
				ready := strings.Contains(out.String(), "READY")
				mu.Unlock()
				if ready {
					break
				}
				if time.Now().After(deadline) {
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
					t.Fatalf("never saw READY on the terminal; stderr %q", stderr.String())
				}
				time.Sleep(10 * time.Millisecond)
			}
			raw, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
			if err != nil {
				t.Fatal(err)
			}
			if raw.Lflag&(unix.ECHO|unix.ICANON) != 0 {
				t.Errorf("the terminal is not raw while the command runs: lflag %#x", raw.Lflag)
			}
			for range c.signals {
				_ = cmd.Process.Signal(syscall.SIGTERM)
				time.Sleep(200 * time.Millisecond)
			}
			code := exitCodeOf(t, cmd.Wait())
			t.Logf("%s: exit %d, stderr %q", c.name, code, stderr.String())
			if code == 0 || code == -1 {
				t.Errorf("%s: exit %d, want cage's own failure", c.name, code)
			}
			noPanic(t, stderr.String())
			after, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
			if err != nil {
				t.Fatal(err)
			}
			if after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag {
				t.Errorf("%s: cage left the terminal changed: lflag %#x iflag %#x oflag %#x, was %#x %#x %#x", c.name,
					after.Lflag, after.Iflag, after.Oflag, before.Lflag, before.Iflag, before.Oflag)
			}
		})
	}
	e.noLeftovers()
}
