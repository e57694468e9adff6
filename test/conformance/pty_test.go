package conformance

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
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
