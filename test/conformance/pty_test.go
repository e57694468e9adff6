package conformance

import (
	"context"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// Commands in a PTY: a terminal of the requested size, interactive input,
// and resizing while the command runs.

func withPTY(cols, rows uint32) func(*agentclient.RunOptions) {
	return func(o *agentclient.RunOptions) { o.PTY = &pb.PTY_Size{Cols: cols, Rows: rows} }
}

// waitFor polls out until it contains s.
func waitFor(t *testing.T, out *testutil.SyncBuffer, s string, d time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if strings.Contains(out.String(), s) {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Errorf("no %q in the PTY output within %v: %q", s, d, clip(out.String()))
	return false
}

func TestPTY(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})

		r := b.run(withPTY(100, 30), withTimeout(20*time.Second), func(o *agentclient.RunOptions) {
			o.Cmd, o.Args = "bash", []string{"-c", "test -t 0 && test -t 1 && echo is-a-tty; stty size; tty"}
		})
		if r.err != nil || r.code() != 0 {
			t.Fatalf("pty command: %v %+v", r.err, r.end)
		}
		if !strings.Contains(r.stdout, "is-a-tty") || !strings.Contains(r.stdout, "30 100") || !strings.Contains(r.stdout, "/dev/pts/") {
			t.Errorf("pty output: %q", r.stdout)
		}
		if r.stderr != "" {
			t.Errorf("a PTY command has no separate stderr, got %q", r.stderr)
		}

		// Interactive: a shell reads commands from the terminal.
		r = b.run(withPTY(80, 24), withTimeout(20*time.Second),
			withStdin(strings.NewReader("echo hi-$((1+2))\nexit 5\n")),
			func(o *agentclient.RunOptions) { o.Cmd, o.Args = "bash", nil })
		if r.err != nil || r.code() != 5 || !strings.Contains(r.stdout, "hi-3") {
			t.Errorf("interactive bash: %v %+v %q", r.err, r.end, clip(r.stdout))
		}

		// Resize mid-run.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		in, inW := io.Pipe()
		defer inW.Close()
		var out testutil.SyncBuffer
		pids := make(chan uint32, 1)
		done := make(chan result, 1)
		go func() {
			done <- b.run(withPTY(100, 30), withTimeout(25*time.Second), withStdin(in), func(o *agentclient.RunOptions) {
				o.Cmd, o.Args = "bash", []string{"--norc", "--noprofile", "-i"}
				o.Stdout = &out
				o.OnStart = func(pid uint32) { pids <- pid }
			})
		}()
		var pid uint32
		select {
		case pid = <-pids:
		case r := <-done:
			t.Fatalf("the PTY shell ended at once: %v %+v", r.err, r.end)
		}
		say := func(s string) {
			if _, err := io.WriteString(inW, s); err != nil {
				t.Errorf("write to the PTY: %v", err)
			}
		}
		say("echo size-$(stty size | tr ' ' x)\n")
		waitFor(t, &out, "size-30x100", 10*time.Second)
		_, err := b.Process.Update(ctx, connect.NewRequest(&pb.UpdateRequest{
			Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}},
			Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 132, Rows: 43}},
		}))
		if err != nil {
			t.Errorf("resize: %v", err)
		}
		say("echo size-$(stty size | tr ' ' x)\n")
		waitFor(t, &out, "size-43x132", 10*time.Second)
		say("exit 0\n")
		select {
		case r := <-done:
			if r.err != nil || r.code() != 0 {
				t.Errorf("the PTY shell: %v %+v", r.err, r.end)
			}
		case <-ctx.Done():
			t.Fatalf("the PTY shell did not exit: %q", clip(out.String()))
		}

		// Resizing a command that has no PTY is refused.
		r = b.sh("sleep 0.2", func(o *agentclient.RunOptions) {
			o.OnStart = func(pid uint32) {
				_, err := b.Process.Update(ctx, connect.NewRequest(&pb.UpdateRequest{
					Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid}},
					Pty:     &pb.PTY{Size: &pb.PTY_Size{Cols: 10, Rows: 10}},
				}))
				if connect.CodeOf(err) != connect.CodeInvalidArgument {
					t.Errorf("resizing a command without a PTY: %v", err)
				}
			}
		})
		if r.err != nil || r.code() != 0 {
			t.Errorf("sleep: %v %+v", r.err, r.end)
		}
	})
}

// ptyHoarder opens as many ptys as it can (at most 5,000), says how many
// and why it stopped, and holds them until /tmp/stop (at most 60 s).
const ptyHoarder = `
import os, sys, time
held = []
why = "cap"
try:
    while len(held) < 5000:
        held.append(os.openpty())
except OSError as e:
    why = str(e.errno)
print(len(held), why, flush=True)
open("/tmp/held", "w").write("%d %s" % (len(held), why))
deadline = time.time() + 60
while not os.path.exists("/tmp/stop") and time.time() < deadline:
    time.sleep(0.05)
`

// Attack: a sandbox opens every pty it can and holds them. The kernel's
// count of ptys (kernel.pty.max) is the host's, shared by every devpts
// instance: found by review, 2026-12-03, one sandbox could take them all,
// and then no other sandbox could open a terminal (E2B's PTY sessions).
// Expected: each sandbox's devpts holds at most inside.MaxPtys (ENOSPC
// past it) where the host's kernel serves it (process, runc); on every
// wall another sandbox still opens one meanwhile.
func TestPtysBoundedPerSandbox(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		a := w.newBox(t, sandbox.Options{})
		b := w.newBox(t, sandbox.Options{})
		if r := a.sh("command -v python3"); r.code() != 0 {
			t.Skipf("no python3 on %s's default template", w.name)
		}
		a.mustSh("cat > /tmp/hoard.py <<'EOF'\n" + ptyHoarder + "EOF")
		out := make(chan result, 1)
		go func() { out <- a.sh("python3 /tmp/hoard.py") }()
		var held string
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if r := a.sh("cat /tmp/held 2>/dev/null"); r.code() == 0 && r.stdout != "" {
				held = strings.TrimSpace(r.stdout)
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the hoarder never said how many ptys it holds")
			}
		}
		if r := b.sh(`python3 -c 'import os; os.openpty(); print("ok")'`); r.code() != 0 || strings.TrimSpace(r.stdout) != "ok" {
			t.Errorf("another sandbox opening a pty while the first holds %s: %v %q %q", held, r.err, r.stdout, r.stderr)
		}
		a.mustSh("touch /tmp/stop")
		if r := <-out; r.code() != 0 {
			t.Fatalf("the hoarder: %v %q %q", r.err, r.stdout, r.stderr)
		}
		if w.name == "process" || w.name == "runc" {
			if want := fmt.Sprintf("%d 28", inside.MaxPtys); held != want { // ENOSPC
				t.Errorf("the sandbox held %q ptys (count, errno); want %q: its devpts's own bound", held, want)
			}
		}
		t.Logf("%s: the hoarder held %s", w.name, held)
	})
}
