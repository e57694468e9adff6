package conformance

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

func TestRunBasics(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		if got := b.mustSh("echo hello; echo oops >&2"); got != "hello\n" {
			t.Errorf("stdout = %q", got)
		}
		r := b.sh("echo out; echo err >&2; exit 3")
		if r.err != nil || r.code() != 3 || r.stdout != "out\n" || r.stderr != "err\n" {
			t.Errorf("exit 3: %+v", r)
		}
		if !r.end.GetExited() || r.end.GetReason() != "exited" || r.end.GetStatus() != "exit status 3" {
			t.Errorf("end event: %+v", r.end)
		}
		r = b.run(func(o *agentclient.RunOptions) { o.Cmd, o.Args = "printf", []string{"%s-%s", "a b", "c"} })
		if r.stdout != "a b-c" {
			t.Errorf("argv form: %q %v", r.stdout, r.err)
		}
	})
}

func TestEnvCwdUser(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{Env: map[string]string{"SANDBOX_WIDE": "yes"}})
		out := b.mustSh(`echo "$FOO $SANDBOX_WIDE $HOME $USER $(pwd) $(id -u):$(id -g)"`, func(o *agentclient.RunOptions) {
			o.Env = map[string]string{"FOO": "bar"}
		})
		if out != "bar yes /home/user user /home/user 1000:1000\n" {
			t.Errorf("default env/cwd/user: %q", out)
		}
		out = b.mustSh("pwd", func(o *agentclient.RunOptions) { o.Cwd = "/tmp" })
		if out != "/tmp\n" {
			t.Errorf("cwd: %q", out)
		}
		out = b.mustSh(`id -u; grep -E '^Cap(Prm|Eff|Inh|Amb)' /proc/self/status | awk '{print $2}' | sort -u`, asUser("root"))
		if out != "0\n0000000000000000\n" {
			t.Errorf("root in the sandbox must have uid 0 and no capabilities, got %q", out)
		}
		r := b.sh("true", asUser("nosuchuser"))
		if connect.CodeOf(r.err) != connect.CodeInvalidArgument {
			t.Errorf("unknown user: %v", r.err)
		}
		r = b.sh("true", func(o *agentclient.RunOptions) { o.Cwd = "/does/not/exist" })
		if connect.CodeOf(r.err) != connect.CodeInvalidArgument {
			t.Errorf("missing cwd: %v", r.err)
		}
	})
}

func TestCommandNotFound(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		r := b.run(func(o *agentclient.RunOptions) { o.Cmd = "no-such-command" })
		if connect.CodeOf(r.err) != connect.CodeNotFound {
			t.Errorf("argv: want not_found, got %v", r.err)
		}
		if r := b.sh("no-such-command"); r.code() != 127 {
			t.Errorf("via bash: want 127, got %d", r.code())
		}
		if r := b.run(func(o *agentclient.RunOptions) { o.Cmd = "/etc/passwd" }); connect.CodeOf(r.err) != connect.CodePermissionDenied {
			t.Errorf("not executable: want permission_denied, got %v", r.err)
		}
	})
}

func TestStdin(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		in := strings.Repeat("line of input\n", 10000)
		out := b.mustSh("wc -l; cat /dev/stdin | wc -c", withStdin(strings.NewReader(in)))
		if out != "10000\n0\n" {
			t.Errorf("stdin: %q", out)
		}
		// Without stdin, reading gets EOF at once.
		if out := b.mustSh("cat; echo done"); out != "done\n" {
			t.Errorf("no stdin: %q", out)
		}
	})
}

func TestTimeoutAndSignals(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		start := time.Now()
		r := b.sh("while :; do :; done", withTimeout(300*time.Millisecond))
		if r.err != nil || r.end.GetReason() != "timeout" || r.end.GetExited() {
			t.Errorf("CPU spin with a timeout: %+v %v", r.end, r.err)
		}
		if time.Since(start) > 20*time.Second {
			t.Errorf("the timeout did not stop the spin")
		}
		r = b.sh("kill -TERM $$; sleep 5")
		if r.end.GetReason() != "signal" || r.end.GetStatus() != "signal: terminated" || r.end.GetExitCode() != -1 {
			t.Errorf("killed by a signal: %+v", r.end)
		}
	})
}

func TestOutputCap(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		r := b.sh("head -c 5000000 /dev/zero; echo tail-marker >&2", func(o *agentclient.RunOptions) { o.MaxOutput = 1 << 20 })
		if r.err != nil || r.code() != 0 {
			t.Fatalf("flood: %v %+v", r.err, r.end)
		}
		if len(r.stdout)+len(r.stderr) != 1<<20 || !r.end.GetTruncated() {
			t.Errorf("forwarded %d bytes, truncated=%v; want exactly 1MiB and truncated", len(r.stdout)+len(r.stderr), r.end.GetTruncated())
		}
	})
}
