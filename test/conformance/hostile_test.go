package conformance

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// The hostile-workload table: each row is a probe a malicious or broken
// workload would try, run inside a sandbox, with the outcome the wall must
// produce. After every row the runner also checks that the host and the
// other sandboxes are untouched: the host's canary files are intact, the
// host can still fork, a witness sandbox still answers and still holds its
// own marker, no output carries the canary secret or the agent's token, and
// (unless the row says the probe may take the sandbox down) the probed
// sandbox's agent still answers.
//
// The rows are split by theme: resource exhaustion in
// hostile_resource_test.go, privilege and kernel-surface probes in
// hostile_kernel_test.go, and escapes towards the host, other sandboxes and
// the network in hostile_escape_test.go. (A CPU spin stopped by its timeout
// is TestTimeoutAndSignals in basic_test.go.)

// hostileRow is one probe.
type hostileRow struct {
	name   string
	expect string   // the expected outcome, in words (printed with failures)
	users  []string // who runs the probe: a subtest per user; default "user"
	// opts, when set, gives the probe a fresh sandbox with these options;
	// nil runs it in the sandbox the table shares.
	opts *sandbox.Options
	// The probe: a bash script, or an argv (python3 -c ... built with py).
	script string
	argv   []string
	mods   func(e *hostileEnv) []func(*agentclient.RunOptions)
	check  func(t *testing.T, r result)
	// custom replaces script/argv/check for probes that drive boxes or the
	// host themselves.
	custom func(t *testing.T, e *hostileEnv, b *box, user string)
	// mayDie: the probe may leave its (fresh) sandbox unusable.
	mayDie bool
	// on gives the outcome on a wall where it differs (gVisor answers some
	// probes from its own kernel).
	on map[string]wallOutcome
}

// wallOutcome is a row's expected outcome on one wall; it replaces the
// row's expect, and its check or custom probe where set.
type wallOutcome struct {
	expect string
	check  func(t *testing.T, r result)
	custom func(t *testing.T, e *hostileEnv, b *box, user string)
	mayDie bool
}

// hostileEnv is what the rows share: the wall, the host's canaries, the
// shared sandbox and a witness sandbox that no probe runs in.
type hostileEnv struct {
	w       wall
	secret  string   // content of the host canaries
	canary  []string // host paths of the canary files
	shared  *box
	witness *box
	marker  string // a secret the witness holds in /tmp/marker
}

func TestHostileWorkloads(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		e := newHostileEnv(t, w)
		for _, row := range hostileRows(e) {
			users := row.users
			if len(users) == 0 {
				users = []string{"user"}
			}
			for _, u := range users {
				name := row.name
				if len(row.users) > 1 {
					name += "/" + u
				}
				t.Run(name, func(t *testing.T) { e.runRow(t, row, u) })
			}
		}
	})
}

func hostileRows(e *hostileEnv) []hostileRow {
	var rows []hostileRow
	rows = append(rows, resourceRows()...)
	rows = append(rows, kernelRows()...)
	rows = append(rows, escapeRows(e)...)
	return rows
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newHostileEnv(t *testing.T, w wall) *hostileEnv {
	e := &hostileEnv{w: w, secret: "cage-secret-" + randHex(16), marker: "witness-" + randHex(8)}
	id := randHex(6)
	if err := os.MkdirAll("/home", 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/root/cage-canary-" + id, "/home/cage-canary-" + id + ".txt"} {
		if err := os.WriteFile(p, []byte(e.secret+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		e.canary = append(e.canary, p)
		t.Cleanup(func() { os.Remove(p) })
	}
	e.shared = w.newBox(t, sandbox.Options{})
	e.witness = w.newBox(t, sandbox.Options{})
	e.witness.mustSh("echo " + e.marker + " > /tmp/marker")
	return e
}

// forT returns a copy of b whose helpers report to t (a box shared between
// subtests must not fail its creator's test from a subtest).
func (b *box) forT(t *testing.T) *box {
	c := *b
	c.t = t
	return &c
}

func (e *hostileEnv) runRow(t *testing.T, row hostileRow, user string) {
	if ov, ok := row.on[e.w.name]; ok {
		row.expect, row.mayDie = ov.expect, ov.mayDie
		if ov.check != nil {
			row.check = ov.check
		}
		if ov.custom != nil {
			row.custom = ov.custom
		}
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("expected outcome: %s", row.expect)
		}
	})
	b := e.shared.forT(t)
	if row.opts != nil {
		b = e.w.newBox(t, *row.opts)
	}
	if row.custom != nil {
		row.custom(t, e, b, user)
	} else {
		mods := []func(*agentclient.RunOptions){asUser(user), withTimeout(30 * time.Second)}
		if row.mods != nil {
			mods = append(mods, row.mods(e)...)
		}
		var r result
		if row.argv != nil {
			mods = append(mods, func(o *agentclient.RunOptions) { o.Cmd, o.Args = row.argv[0], row.argv[1:] })
			r = b.run(mods...)
		} else {
			r = b.sh(row.script, mods...)
		}
		if r.err != nil {
			if b.agentDied() {
				t.Fatalf("the probe killed the sandbox's agent: %v (%v)", r.err, b.sb.Err())
			}
			t.Fatalf("the probe did not run or its stream broke: %v", r.err)
		}
		e.noLeak(t, b, r.stdout+r.stderr)
		row.check(t, r)
		if t.Failed() {
			t.Logf("end=%+v\nstdout=%q\nstderr=%q", r.end, clip(r.stdout), clip(r.stderr))
		}
	}
	if !row.mayDie {
		e.answers(t, b, "the probed sandbox")
	}
	e.hostIntact(t)
}

func clip(s string) string {
	if len(s) > 4000 {
		return s[:4000] + "…"
	}
	return s
}

// noLeak fails when out carries the host canary or the agent's token.
func (e *hostileEnv) noLeak(t *testing.T, b *box, out string) {
	t.Helper()
	if strings.Contains(out, e.secret) {
		t.Errorf("LEAK: the host canary's secret appears in the sandbox's output")
	}
	if b.sb != nil && b.sb.Token() != "" && strings.Contains(out, b.sb.Token()) {
		t.Errorf("LEAK: the agent's access token appears in the sandbox's output")
	}
}

// agentDied reports whether the sandbox's agent has exited (waiting a moment
// for the host to reap it after a broken stream).
func (b *box) agentDied() bool {
	if b.sb == nil {
		return false
	}
	select {
	case <-b.sb.Exited():
		return true
	case <-time.After(time.Second):
		return false
	}
}

// answers checks that a sandbox's agent still runs commands.
func (e *hostileEnv) answers(t *testing.T, b *box, what string) {
	t.Helper()
	r := b.forT(t).sh("echo alive", withTimeout(20*time.Second))
	if r.err != nil || r.code() != 0 || r.stdout != "alive\n" {
		t.Errorf("%s no longer answers: err=%v end=%+v out=%q", what, r.err, r.end, r.stdout)
	}
}

// hostIntact checks the host and the witness sandbox after a probe.
func (e *hostileEnv) hostIntact(t *testing.T) {
	t.Helper()
	for _, p := range e.canary {
		if b, err := os.ReadFile(p); err != nil || string(b) != e.secret+"\n" {
			t.Errorf("host canary %s changed: %q %v", p, b, err)
		}
	}
	if out, err := exec.Command("/bin/sh", "-c", "echo forked").Output(); err != nil || string(out) != "forked\n" {
		t.Errorf("the host cannot fork: %v %q", err, out)
	}
	r := e.witness.forT(t).sh("cat /tmp/marker", withTimeout(20*time.Second))
	if r.err != nil || r.stdout != e.marker+"\n" {
		t.Errorf("the witness sandbox was disturbed: err=%v end=%+v out=%q", r.err, r.end, r.stdout)
	}
}

// Check helpers.

// exitsOK wants exit 0 and every string in want on stdout.
func exitsOK(want ...string) func(*testing.T, result) {
	return func(t *testing.T, r result) {
		t.Helper()
		if r.code() != 0 {
			t.Errorf("exit %d (%s), want 0", r.code(), r.end.GetReason())
		}
		for _, w := range want {
			if !strings.Contains(r.stdout, w) {
				t.Errorf("stdout lacks %q", w)
			}
		}
	}
}

// fails wants a non-zero exit and every string in want in stdout+stderr.
func fails(want ...string) func(*testing.T, result) {
	return func(t *testing.T, r result) {
		t.Helper()
		if r.code() == 0 {
			t.Errorf("the probe succeeded (exit 0), want a failure")
		}
		for _, w := range want {
			if !strings.Contains(r.stdout+r.stderr, w) {
				t.Errorf("output lacks %q", w)
			}
		}
	}
}

// noneOf adds to c: none of bad may appear in stdout.
func noneOf(c func(*testing.T, result), bad ...string) func(*testing.T, result) {
	return func(t *testing.T, r result) {
		t.Helper()
		c(t, r)
		for _, s := range bad {
			if strings.Contains(r.stdout, s) {
				t.Errorf("stdout shows %q", s)
			}
		}
	}
}

// pyPrelude gives python probes sc(nr, *args) -> "ret ERRNO" and show(...),
// which prints "name=ret ERRNO".
const pyPrelude = `import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    e = ctypes.get_errno()
    return "%d %s" % (r, errno.errorcode.get(e, str(e)) if r < 0 else "OK")
def show(name, nr, *args):
    print("%s=%s" % (name, sc(nr, *args)), flush=True)
def trysock(name, *args):
    try:
        socket.socket(*args).close()
        print("%s=OPENED" % name, flush=True)
    except OSError as ex:
        print("%s=%s %s" % (name, type(ex).__name__, errno.errorcode.get(ex.errno)), flush=True)
`

// py is the argv of a python probe.
func py(code string) []string { return []string{"python3", "-c", pyPrelude + code} }
