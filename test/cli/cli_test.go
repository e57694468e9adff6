// Package clitest runs the cage binary as a user meets it: exit codes,
// stdout and stderr, stdin, flags, copy-in, a terminal, signals, and the
// state a run leaves behind (none).
package clitest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// Exit codes of cage itself (internal/cli/cli.go).
const (
	exitUsage      = 64
	exitNoTemplate = 66
	exitNoPerm     = 77
	exitTimeout    = 124
	exitNotExec    = 126
	exitNotFound   = 127
)

// env is one test's cage: the binary and a private run directory.
type env struct {
	t      *testing.T
	bin    string
	runDir string
	// cgroups holds the sandbox cgroups under the cage parent that existed
	// when the test started (other tests' sandboxes may live beside ours).
	cgroups map[string][]string
}

func setup(t *testing.T) *env {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	bin := filepath.Join(testutil.Binaries(t), "cage")
	return &env{t: t, bin: bin, runDir: testutil.RunDir(t), cgroups: cageCgroups()}
}

// result is how one cage invocation went.
type result struct {
	stdout, stderr string
	code           int
	took           time.Duration
	// ids are the sandbox ids seen in RUN_DIR/sandboxes while it ran.
	ids []string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d after %v, stdout %q, stderr %q", r.code, r.took.Round(time.Millisecond), r.stdout, r.stderr)
}

// command builds `cage --run-dir RUN_DIR ARGS...` with cage's own
// environment variables removed, so that it finds cage-agent beside itself.
func (e *env) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, e.bin, append([]string{"--run-dir", e.runDir}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAGE_") || strings.HasPrefix(kv, "CAGE_RUNSC=") { // where runsc is, not a setting
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// cage runs cage to its end with stdin (nil: /dev/null) and checks what
// every invocation must honour: no Go panic or stack trace on stderr.
func (e *env) cage(stdin io.Reader, args ...string) result {
	e.t.Helper()
	return e.cageEnv(stdin, nil, args...)
}

// cageEnv is cage with env added to cage's environment.
func (e *env) cageEnv(stdin io.Reader, env []string, args ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := e.command(ctx, args...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	if err := cmd.Start(); err != nil {
		e.t.Fatalf("start cage: %v", err)
	}
	stop := e.watchIDs()
	err := cmd.Wait()
	r := result{stdout: out.String(), stderr: errb.String(), took: time.Since(start), ids: stop()}
	r.code = exitCodeOf(e.t, err)
	e.t.Logf("cage %s: %v", strings.Join(args, " "), r)
	noPanic(e.t, r.stderr)
	return r
}

func exitCodeOf(t *testing.T, err error) int {
	t.Helper()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			t.Errorf("cage itself was killed by %v", ws.Signal())
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	t.Fatalf("wait for cage: %v", err)
	return -1
}

func noPanic(t *testing.T, stderr string) {
	t.Helper()
	if strings.Contains(stderr, "goroutine ") || strings.Contains(stderr, "panic:") {
		t.Errorf("cage printed a Go panic or stack trace:\n%s", stderr)
	}
}

// watchIDs records the sandbox ids that appear in RUN_DIR/sandboxes until
// the returned function is called.
func (e *env) watchIDs() func() []string {
	done := make(chan struct{})
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			ents, _ := os.ReadDir(filepath.Join(e.runDir, "sandboxes"))
			mu.Lock()
			for _, d := range ents {
				seen[d.Name()] = true
			}
			mu.Unlock()
			select {
			case <-done:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	return func() []string {
		close(done)
		wg.Wait()
		var ids []string
		for id := range seen {
			ids = append(ids, id)
		}
		return ids
	}
}

// oneLine checks that stderr is exactly one line starting with "cage: " and
// that it contains each of want.
func oneLine(t *testing.T, what, stderr string, want ...string) {
	t.Helper()
	if !strings.HasPrefix(stderr, "cage: ") || !strings.HasSuffix(stderr, "\n") || strings.Count(stderr, "\n") != 1 {
		t.Errorf("%s: stderr must be one line starting with \"cage: \", got %q", what, stderr)
	}
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			t.Errorf("%s: stderr %q does not mention %q", what, stderr, w)
		}
	}
}

// cageCgroups lists the sandbox cgroups under the cage parent, in every
// hierarchy: name -> directories.
func cageCgroups() map[string][]string {
	groups := map[string][]string{}
	for _, pattern := range []string{"/sys/fs/cgroup/*/cage/*", "/sys/fs/cgroup/cage/*"} {
		paths, _ := filepath.Glob(pattern)
		for _, p := range paths {
			if fi, err := os.Stat(p); err == nil && fi.IsDir() {
				groups[filepath.Base(p)] = append(groups[filepath.Base(p)], p)
			}
		}
	}
	return groups
}

// foreign reports whether a cgroup belongs to a live sandbox of some other
// creator: its agent (the process whose parent is outside the group) has a
// live parent other than init. cage's own runs have ended by the time this
// is asked, and their agents die with them, so a group with such an agent is
// another process's (a test running beside this one).
func foreign(dirs []string) bool {
	for _, dir := range dirs {
		data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			continue
		}
		in := map[int]bool{}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				in[pid] = true
			}
		}
		for pid := range in {
			pp := ppid(pid)
			if pp > 1 && !in[pp] && ppid(pp) >= 0 {
				return true
			}
		}
	}
	return false
}

// ppid returns pid's parent, or -1 when pid is gone.
func ppid(pid int) int {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "PPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return -1
}

// noLeftovers checks that the runs so far left nothing: RUN_DIR/sandboxes
// and RUN_DIR/ids are empty (or were never made), the cgroups of the
// sandboxes in ids are gone, and no new cgroup is left under the cage parent.
func (e *env) noLeftovers(ids ...string) {
	e.t.Helper()
	for _, sub := range []string{"sandboxes", "ids"} {
		ents, err := os.ReadDir(filepath.Join(e.runDir, sub))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			e.t.Errorf("read %s: %v", sub, err)
		}
		for _, d := range ents {
			e.t.Errorf("left behind: %s", filepath.Join(e.runDir, sub, d.Name()))
		}
	}
	now := cageCgroups()
	for _, id := range ids {
		for _, dir := range now[id] {
			e.t.Errorf("left behind: cgroup %s of sandbox %s", dir, id)
		}
	}
	// Other sandboxes (of tests running beside this one) come and go: give
	// new groups a moment to disappear, then fail for any that is not a
	// live sandbox of someone else.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for name, dirs := range cageCgroups() {
			if _, ok := e.cgroups[name]; !ok && !foreign(dirs) {
				left = append(left, dirs...)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			e.t.Errorf("cgroups left behind under the cage parent: %v", left)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestRunEcho(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--", "echo", "hello")
	if r.code != 0 || r.stdout != "hello\n" || r.stderr != "" {
		t.Errorf("cage run -- echo hello: %v; want exit 0, stdout \"hello\\n\", empty stderr", r)
	}
	e.noLeftovers(r.ids...)
}

func TestExitCodes(t *testing.T) {
	e := setup(t)
	for _, tc := range []struct {
		name string
		args []string
		code int
	}{
		{"exit 42", []string{"sh", "-c", "exit 42"}, 42},
		{"killed by SIGTERM", []string{"sh", "-c", "kill -TERM $$"}, 128 + 15},
		{"killed by SIGKILL", []string{"sh", "-c", "kill -KILL $$"}, 128 + 9},
		{"false", []string{"false"}, 1},
	} {
		r := e.cage(nil, append([]string{"run", "--"}, tc.args...)...)
		if r.code != tc.code || r.stdout != "" || r.stderr != "" {
			t.Errorf("%s: %v; want exit %d and no output", tc.name, r, tc.code)
		}
	}
	e.noLeftovers()
}

func TestCommandNotRunnable(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--", "no-such-cmd")
	if r.code != exitNotFound || r.stdout != "" {
		t.Errorf("command not found: %v; want exit %d", r, exitNotFound)
	}
	oneLine(t, "command not found", r.stderr, "no-such-cmd")

	r = e.cage(nil, "run", "--", "/etc/passwd")
	if r.code != exitNotExec || r.stdout != "" {
		t.Errorf("not executable: %v; want exit %d", r, exitNotExec)
	}
	oneLine(t, "not executable", r.stderr, "/etc/passwd")

	r = e.cage(nil, "run", "--", "/no/such/dir/cmd")
	if r.code != exitNotFound {
		t.Errorf("missing path: %v; want exit %d", r, exitNotFound)
	}
	oneLine(t, "missing path", r.stderr, "/no/such/dir/cmd")
	e.noLeftovers()
}

func TestBadInput(t *testing.T) {
	e := setup(t)
	for _, tc := range []struct {
		args []string
		code int
		want string // the message mentions it
	}{
		{[]string{"run", "--template", "nope", "--", "true"}, exitNoTemplate, "nope"},
		{[]string{"run", "--memory", "abc", "--", "true"}, exitUsage, "memory"},
		{[]string{"run", "--memory", "1M", "--", "true"}, exitUsage, "memory"},
		{[]string{"run", "--pids", "1", "--", "true"}, exitUsage, "pids"},
		{[]string{"run", "--pids", "many", "--", "true"}, exitUsage, "pids"},
		{[]string{"run", "--cpus", "0.001", "--", "true"}, exitUsage, "cpus"},
		{[]string{"run", "--disk", "10", "--", "true"}, exitUsage, "disk"},
		{[]string{"run", "--timeout", "soon", "--", "true"}, exitUsage, "timeout"},
		// Above the host's maxima, or too large to be a duration: refused
		// with the maximum named, never wrapped into something small.
		{[]string{"run", "--memory", "100T", "--", "true"}, exitUsage, "maximum"},
		{[]string{"run", "--disk", "100T", "--", "true"}, exitUsage, "maximum"},
		{[]string{"run", "--cpus", "100000", "--", "true"}, exitUsage, "maximum"},
		{[]string{"run", "--pids", "10000000", "--", "true"}, exitUsage, "maximum"},
		{[]string{"run", "--timeout", "18446744074", "--", "true"}, exitUsage, "timeout"},
		{[]string{"run", "--env", "NOEQUALS", "--", "true"}, exitUsage, "NOEQUALS"},
		{[]string{"run", "--copy-in", "/nonexistent:/x", "--", "true"}, exitUsage, "/nonexistent"},
		{[]string{"run", "--tty", "sometimes", "--", "true"}, exitUsage, "sometimes"},
		{[]string{"run", "--frobnicate", "--", "true"}, exitUsage, "frobnicate"},
		{[]string{"run", "--net", "everything", "--", "true"}, exitUsage, "everything"},
		{[]string{"run", "--allow", "::1", "--", "true"}, exitUsage, "IPv4"},
		{[]string{"run", "--allow", "exa mple.com", "--", "true"}, exitUsage, "exa mple.com"},
		{[]string{"run", "--allow", "example.com:99999", "--", "true"}, exitUsage, "port"},
		{[]string{"run", "--net", "none", "--allow", "example.com", "--", "true"}, exitUsage, "none"},
		{[]string{"run", "--net", "allowlist", "--deny", "1.2.3.4", "--", "true"}, exitUsage, "deny"},
		{[]string{"run"}, exitUsage, ""},
		{[]string{"serve", "--pool-of", "nowall/base=1"}, exitUsage, "nowall"},
	} {
		name := strings.Join(tc.args, " ")
		r := e.cage(nil, tc.args...)
		if r.code != tc.code {
			t.Errorf("cage %s: exit %d, want %d (stderr %q)", name, r.code, tc.code, r.stderr)
		}
		if r.stdout != "" {
			t.Errorf("cage %s: stdout %q, want none", name, r.stdout)
		}
		oneLine(t, "cage "+name, r.stderr, tc.want)
		e.noLeftovers(r.ids...)
	}
}

func TestTimeout(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--timeout", "1s", "--", "sleep", "30")
	if r.code != exitTimeout {
		t.Errorf("--timeout 1s -- sleep 30: %v; want exit %d", r, exitTimeout)
	}
	if r.took > 15*time.Second {
		t.Errorf("--timeout 1s took %v", r.took)
	}
	oneLine(t, "timeout", r.stderr, "timed out")
	if len(r.ids) == 0 {
		t.Errorf("never saw the sandbox in %s/sandboxes", e.runDir)
	}
	e.noLeftovers(r.ids...)
}

func TestOutOfMemory(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--memory", "64M", "--", "python3", "-c", "b=bytearray(500*1024*1024)")
	if r.code != 128+9 {
		t.Errorf("OOM: %v; want exit 137", r)
	}
	if !strings.Contains(r.stderr, "out of memory") {
		t.Errorf("OOM: stderr %q does not say out of memory", r.stderr)
	}
	e.noLeftovers(r.ids...)
}

// TestOutOfMemoryInTheKernel: memory the workload holds in the kernel
// (unix sockets' queued bytes) is the sandbox's, but no process's: the
// OOM killer may then take the agent, the group's largest member. Cage
// says the sandbox ran out of memory (it said "protocol error: incomplete
// envelope", exit 64, a usage error), whichever the kernel killed, and
// leaves nothing behind.
func TestOutOfMemoryInTheKernel(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--memory", "64M", "--", "python3", "-c", `
import socket
held = []
for i in range(3000):
    a, b = socket.socketpair(); a.setblocking(False)
    try:
        while True: a.send(b"x" * 65536)
    except BlockingIOError:
        pass
    held.append((a, b))
print("HELD ALL")`)
	if r.code == 0 || r.code == 64 || !strings.Contains(r.stderr, "out of memory") || strings.Contains(r.stdout, "HELD ALL") {
		t.Errorf("unix sockets filled past memory=64M: %v; want an exit that is neither 0 nor 64 and a message saying out of memory", r)
	}
	oneLine(t, "kernel OOM", r.stderr, "out of memory")
	e.noLeftovers(r.ids...)
}

func TestStdin(t *testing.T) {
	e := setup(t)
	r := e.cage(strings.NewReader("hi\n"), "run", "--", "cat")
	if r.code != 0 || r.stdout != "hi\n" || r.stderr != "" {
		t.Errorf("echo hi | cage run -- cat: %v", r)
	}
	r = e.cage(bytes.NewReader(make([]byte, 5<<20)), "run", "--", "wc", "-c")
	if r.code != 0 || strings.TrimSpace(r.stdout) != "5242880" {
		t.Errorf("5 MiB through wc -c: %v", r)
	}
	// No stdin at all (/dev/null): reading gets EOF at once.
	r = e.cage(nil, "run", "--", "sh", "-c", "cat; echo done")
	if r.code != 0 || r.stdout != "done\n" {
		t.Errorf("stdin /dev/null: %v", r)
	}
	e.noLeftovers()
}

// TestMaxOutput: --max-output bounds what cage forwards, stdout and stderr
// together; the rest is read and dropped, so a command that writes far
// more still runs to its end (its exit code is cage's), and cage says the
// output was cut. A background process still writing after the command
// ended does not keep cage waiting.
func TestMaxOutput(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "run", "--max-output", "1K", "--", "sh", "-c",
		`head -c 3000000 /dev/zero | tr '\0' a; head -c 3000000 /dev/zero | tr '\0' b >&2; exit 5`)
	if r.code != 5 || len(r.stdout)+strings.Count(r.stderr, "b") != 1024 || strings.Trim(r.stdout, "a") != "" ||
		!strings.Contains(r.stderr, "cage: output truncated") {
		t.Errorf("3 MB each way past --max-output 1K: exit %d, %d bytes out, stderr %.200q", r.code, len(r.stdout), r.stderr)
	}
	r = e.cage(nil, "run", "--", "sh", "-c", `(while :; do echo bg; sleep 0.01; done) & echo fg`)
	if r.code != 0 || !strings.Contains(r.stdout, "fg\n") || r.took > time.Minute {
		t.Errorf("a command leaving a writer behind: %v", r)
	}
	e.noLeftovers()
}

func TestEnvWorkdirUser(t *testing.T) {
	e := setup(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--env", "A=1", "--env", "B=two", "--", "sh", "-c", "echo $A$B"}, "1two\n"},
		{[]string{"-e", "X=a=b", "--", "sh", "-c", "echo $X"}, "a=b\n"},
		{[]string{"--workdir", "/tmp", "--", "pwd"}, "/tmp\n"},
		{[]string{"--", "pwd"}, "/home/user\n"},
		{[]string{"--user", "root", "--", "id", "-u"}, "0\n"},
		{[]string{"--", "id", "-un"}, "user\n"},
		{[]string{"--", "id", "-u"}, "1000\n"},
	} {
		r := e.cage(nil, append([]string{"run"}, tc.args...)...)
		if r.code != 0 || r.stdout != tc.want || r.stderr != "" {
			t.Errorf("cage run %s: %v; want stdout %q", strings.Join(tc.args, " "), r, tc.want)
		}
	}
	r := e.cage(nil, "run", "--user", "nosuchuser", "--", "true")
	if r.code != exitUsage {
		t.Errorf("unknown user: %v; want exit %d", r, exitUsage)
	}
	oneLine(t, "unknown user", r.stderr)
	r = e.cage(nil, "run", "--workdir", "/does/not/exist", "--", "true")
	if r.code != exitUsage {
		t.Errorf("missing workdir: %v; want exit %d", r, exitUsage)
	}
	oneLine(t, "missing workdir", r.stderr)
	e.noLeftovers()
}

func TestCopyIn(t *testing.T) {
	e := setup(t)
	dir := t.TempDir()
	for p, content := range map[string]string{
		"README":           "top\n",
		"src/main.txt":     "main\n",
		"src/deep/er/leaf": "leaf\n",
	} {
		path := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "run.sh"), []byte("#!/bin/sh\necho script-ran\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("src/deep/er/leaf", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	// t.TempDir's directories are 0700; the copy reads them as root anyway,
	// but make them what a user's project looks like.
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			err = os.Chmod(p, 0o755)
		}
		return err
	})

	r := e.cage(nil, "run", "--copy-in", dir+":/home/user/proj", "--", "sh", "-c",
		`cd proj && ls -R && ./run.sh && readlink link && cat link && test -x run.sh && echo exec-ok &&
		 stat -c '%U:%G %n' . README run.sh src src/deep/er/leaf && find . -type l`)
	want := `.:
README
link
run.sh
src

./src:
deep
main.txt

./src/deep:
er

./src/deep/er:
leaf
script-ran
src/deep/er/leaf
leaf
exec-ok
user:user .
user:user README
user:user run.sh
user:user src
user:user src/deep/er/leaf
./link
`
	if r.code != 0 || r.stdout != want || r.stderr != "" {
		t.Errorf("copy-in: %v\nwant stdout:\n%s", r, want)
	}

	// A copy-in to writable storage outside the home, as root.
	r = e.cage(nil, "run", "--user", "root", "--copy-in", dir+"/src:/tmp/code", "--", "sh", "-c",
		`cat /tmp/code/main.txt; stat -c %U /tmp/code/main.txt`)
	if r.code != 0 || r.stdout != "main\nroot\n" {
		t.Errorf("copy-in as root to /tmp/code: %v", r)
	}
	e.noLeftovers()
}

func TestHostIsInvisible(t *testing.T) {
	e := setup(t)
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	name := "cage-canary-" + hex.EncodeToString(b[:6])
	secret := "secret-" + hex.EncodeToString(b[6:])
	canary := filepath.Join("/root", name)
	if err := os.WriteFile(canary, []byte(secret+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(canary) })
	for _, user := range []string{"user", "root"} {
		r := e.cage(nil, "run", "--user", user, "--", "sh", "-c", "ls -a /root; cat /root/"+name)
		if r.code == 0 {
			t.Errorf("as %s: reading the host's %s succeeded: %v", user, canary, r)
		}
		if strings.Contains(r.stdout+r.stderr, secret) || strings.Contains(r.stdout, name) {
			t.Errorf("as %s: the sandbox saw the host's canary: %v", user, r)
		}
	}
	e.noLeftovers()
}

func TestNotRoot(t *testing.T) {
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := e.command(ctx, "run", "--", "true")
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("cannot run %s as nobody (uid 65534): %v; the built binaries must be readable and executable by all", e.bin, err)
	}
	code := exitCodeOf(t, err)
	t.Logf("cage run as nobody: exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	if code != exitNoPerm || out.String() != "" {
		t.Errorf("as nobody: exit %d, stdout %q; want exit %d", code, out.String(), exitNoPerm)
	}
	oneLine(t, "as nobody", errb.String(), "root")
	noPanic(t, errb.String())
	e.noLeftovers()
}

func TestDoctor(t *testing.T) {
	e := setup(t)
	r := e.cage(nil, "doctor")
	if r.code != 0 {
		t.Errorf("cage doctor: %v; want exit 0", r)
	}
	walls := map[string]string{}
	for _, line := range strings.Split(r.stdout, "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && strings.HasPrefix(f[0], "[") {
			// "[ok  ] name info" splits "[ok" "]" or "[FAIL]".
			mark := strings.Trim(f[0], "[]")
			rest := f[1:]
			if rest[0] == "]" {
				rest = rest[1:]
			}
			if len(rest) > 0 {
				walls[rest[0]] = mark
			}
		}
	}
	for _, w := range []string{"process", "runc", "gvisor", "microvm"} {
		if _, ok := walls[w]; !ok {
			t.Errorf("cage doctor has no line for the %s wall:\n%s", w, r.stdout)
		}
	}
	if walls["process"] != "ok" {
		t.Errorf("cage doctor: the process wall is not ok:\n%s", r.stdout)
	}
	// The network section: this test runs as root in its own network
	// namespace, where nftables works.
	for _, name := range []string{"nftables", "ip forwarding", "veth", "dns"} {
		if walls[strings.Fields(name)[0]] != "ok" {
			t.Errorf("cage doctor: network check %q is not ok:\n%s", name, r.stdout)
		}
	}
	e.noLeftovers(r.ids...)
}

func TestInterruptForwarded(t *testing.T) {
	e := setup(t)
	l := e.startCage("run", "--", "sh", "-c", `trap "echo got-term; exit 7" TERM; echo READY; sleep 30 & wait`)
	if err := l.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	code, took := l.wait(t)
	out := l.output()
	t.Logf("after SIGINT: exit %d after %v, stdout %q, stderr %q", code, took.Round(time.Millisecond), out, l.stderr.String())
	if code != 7 || out != "READY\ngot-term\n" {
		t.Errorf("SIGINT to cage: exit %d, stdout %q; want the command to get SIGTERM (READY, got-term, exit 7)", code, out)
	}
	if took > 25*time.Second {
		t.Errorf("cage waited for the background sleep (%v)", took)
	}
	noPanic(t, l.stderr.String())
	e.noLeftovers()
}

// liveCage is a running cage whose stdout is read line by line.
type liveCage struct {
	cmd    *exec.Cmd
	stderr bytes.Buffer
	mu     sync.Mutex
	out    strings.Builder
	ready  chan struct{}
	eof    chan struct{}
	start  time.Time
	cancel context.CancelFunc
}

// startCage starts cage and returns once the command has printed READY as
// its first line.
func (e *env) startCage(args ...string) *liveCage {
	e.t.Helper()
	return e.startCageEnv(nil, args...)
}

// startCageEnv is startCage with env added to cage's environment.
func (e *env) startCageEnv(env []string, args ...string) *liveCage {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	l := &liveCage{cmd: e.command(ctx, args...), ready: make(chan struct{}), eof: make(chan struct{}), cancel: cancel}
	l.cmd.Env = append(l.cmd.Env, env...)
	stdout, err := l.cmd.StdoutPipe()
	if err != nil {
		e.t.Fatal(err)
	}
	l.cmd.Stderr = &l.stderr
	l.start = time.Now()
	if err := l.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	go func() {
		defer close(l.eof)
		sc := bufio.NewScanner(stdout)
		first := true
		for sc.Scan() {
			l.mu.Lock()
			l.out.WriteString(sc.Text() + "\n")
			l.mu.Unlock()
			if first && sc.Text() == "READY" {
				close(l.ready)
			}
			first = false
		}
	}()
	select {
	case <-l.ready:
	case <-l.eof:
		l.cmd.Wait()
		e.t.Fatalf("cage ended before the command printed READY: stdout %q, stderr %q", l.output(), l.stderr.String())
	case <-time.After(30 * time.Second):
		e.t.Fatal("the command never printed READY")
	}
	return l
}

func (l *liveCage) output() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.out.String()
}

// wait waits for cage's end and returns its exit code and how long it ran.
func (l *liveCage) wait(t *testing.T) (int, time.Duration) {
	t.Helper()
	defer l.cancel()
	<-l.eof
	code := exitCodeOf(t, l.cmd.Wait())
	return code, time.Since(l.start)
}

// A second Ctrl-C destroys the sandbox even when the command ignores the
// forwarded SIGTERM; cage then reports the interruption, 128+SIGINT as a
// shell would, never as a usage error.
func TestSecondInterruptDestroys(t *testing.T) {
	e := setup(t)
	l := e.startCage("run", "--", "sh", "-c", `trap "echo ignoring-term" TERM; echo READY; while :; do sleep 1; done`)
	if err := l.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(l.output(), "ignoring-term") && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := l.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	code, took := l.wait(t)
	stderr := l.stderr.String()
	t.Logf("two SIGINTs: exit %d after %v, stdout %q, stderr %q", code, took.Round(time.Millisecond), l.output(), stderr)
	if took > 20*time.Second {
		t.Errorf("the second SIGINT did not end the run (%v)", took)
	}
	if code != 128+int(syscall.SIGINT) {
		t.Errorf("two SIGINTs: exit %d, stderr %q; want %d (interrupted), not a usage or protocol error", code, stderr, 128+int(syscall.SIGINT))
	}
	// The command's own stderr comes first (sh reports its killed sleep);
	// cage's word is the last line.
	lines := strings.SplitAfter(strings.TrimSuffix(stderr, "\n"), "\n")
	oneLine(t, "two SIGINTs", lines[len(lines)-1]+"\n")
	if strings.Contains(stderr, "protocol error") {
		t.Errorf("two SIGINTs: cage blames the protocol: %q", stderr)
	}
	noPanic(t, stderr)
	e.noLeftovers()
}

// TestSecondInterruptStuckStdout: a consumer of cage's stdout that never
// reads keeps cage's copy of the output waiting, but not past a second
// signal: cage then ends (130) without writing the rest, on the one-shot
// path and on the usual one (--copy-in). Before (a review, 2026-12-03),
// cage waited for the write however many signals came: `cage run -- yes |
// stuck` outlived every SIGTERM.
func TestSecondInterruptStuckStdout(t *testing.T) {
	e := setup(t)
	for _, args := range [][]string{
		{"run", "--", "sh", "-c", "echo READY >&2; exec yes"},
		{"run", "--copy-in", t.TempDir() + ":/tmp/in", "--", "sh", "-c", "echo READY >&2; exec yes"},
	} {
		outR, outW, err := os.Pipe() // never read
		if err != nil {
			t.Fatal(err)
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := e.command(ctx, args...)
		cmd.Stdout, cmd.Stderr = outW, errW
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		outW.Close()
		errW.Close()
		stderr := make(chan string, 1)
		ready := make(chan struct{})
		go func() {
			var b strings.Builder
			sc := bufio.NewScanner(errR)
			for sc.Scan() {
				b.WriteString(sc.Text() + "\n")
				if sc.Text() == "READY" {
					close(ready)
				}
			}
			stderr <- b.String()
		}()
		select {
		case <-ready:
		case <-time.After(30 * time.Second):
			t.Fatalf("%v: the command did not start", args)
		}
		time.Sleep(500 * time.Millisecond) // the output pipe fills
		for range 2 {
			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second)
		}
		err = cmd.Wait()
		took := time.Since(start)
		code := exitCodeOf(t, err)
		text := <-stderr
		t.Logf("%v, stdout never read, two SIGTERMs: exit %d after %v, stderr %q", args, code, took.Round(time.Millisecond), text)
		if code != 130 || took > 20*time.Second || !strings.Contains(text, "interrupted") {
			t.Errorf("%v, stdout never read: two SIGTERMs ended cage with %d after %v (stderr %q); want 130 at once", args, code, took, text)
		}
		cancel()
		outR.Close()
		errR.Close()
	}
	e.noLeftovers()
}

// --timeout bounds the whole run, also when cage's stdout is never read:
// once it fires, cage waits a little for the output to be written out,
// then exits 124 (it waited for the reader until a second signal before).
func TestTimeoutStuckStdout(t *testing.T) {
	e := setup(t)
	for _, args := range [][]string{
		{"run", "--timeout", "3s", "--", "sh", "-c", "exec yes"},
		{"run", "--timeout", "3s", "--copy-in", t.TempDir() + ":/tmp/in", "--", "sh", "-c", "exec yes"},
	} {
		outR, outW, err := os.Pipe() // never read
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		cmd := e.command(ctx, args...)
		var stderr strings.Builder
		cmd.Stdout, cmd.Stderr = outW, &stderr
		start := time.Now()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		outW.Close()
		err = cmd.Wait()
		took := time.Since(start)
		code := exitCodeOf(t, err)
		t.Logf("%v, stdout never read: exit %d after %v, stderr %q", args, code, took.Round(time.Millisecond), stderr.String())
		if code != 124 || ctx.Err() != nil || !strings.Contains(stderr.String(), "timed out") {
			t.Errorf("%v, stdout never read: exit %d after %v (stderr %q); want 124 soon after the 3 s timeout", args, code, took, stderr.String())
		}
		cancel()
		outR.Close()
	}
	e.noLeftovers()
}

// When cage itself is killed (SIGKILL, no chance to clean up), the sandbox
// dies with it: no process of it keeps running.
func TestCageKilled(t *testing.T) {
	for _, wall := range []string{"process", "runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) { cageKilled(t, wall) })
	}
}

// cageKilled: cage run killed with SIGKILL takes its sandbox's processes
// with it on every wall (the OCI walls' agent watches a lifeline pipe, as
// the runtime detaches the container), and the next cage run removes what
// the killed one left on the host.
func cageKilled(t *testing.T, wall string) {
	e := setup(t)
	if wall != "process" {
		bin := map[string]string{"runc": "runc", "gvisor": "runsc"}[wall]
		if _, err := exec.LookPath(bin); err != nil && os.Getenv("CAGE_RUNSC") == "" {
			testutil.SkipWall(t, wall, "%s not installed", bin)
		}
	}
	l := e.startCage("run", "--wall", wall, "--", "sh", "-c", "echo READY; sleep 100")
	ids := dirNames(filepath.Join(e.runDir, "sandboxes"))
	if len(ids) != 1 {
		t.Fatalf("RUN_DIR/sandboxes holds %v while the command runs, want one sandbox", ids)
	}
	groups := cageCgroups()[ids[0]]
	if len(groups) == 0 {
		t.Fatalf("no cgroup for sandbox %s", ids[0])
	}
	// cage cannot clean up after SIGKILL; remove what it leaves so that the
	// host stays clean.
	t.Cleanup(func() {
		for _, dir := range groups {
			_ = syscall.Rmdir(dir)
		}
	})
	if err := l.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-l.eof
	err := l.cmd.Wait()
	l.cancel()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Errorf("cage killed: wait says %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var alive []string
		for _, dir := range groups {
			data, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			for _, pid := range strings.Fields(string(data)) {
				alive = append(alive, pid+" in "+dir)
			}
		}
		if len(alive) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox's processes outlived cage: %v", alive)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("after SIGKILL, cage left (expected: it had no chance to clean up): state %v, cgroups %v",
		dirNames(filepath.Join(e.runDir, "sandboxes")), groups)
	// The next run collects the leftovers (once they are 2 s old).
	time.Sleep(2500 * time.Millisecond)
	if r := e.cage(nil, "run", "--", "true"); r.code != 0 {
		t.Fatalf("the next run: %v", r)
	}
	if left := dirNames(filepath.Join(e.runDir, "sandboxes")); len(left) != 0 {
		t.Errorf("the next cage run left the killed run's state: %v", left)
	}
	for _, dir := range groups {
		if _, err := os.Stat(dir); err == nil {
			t.Errorf("the killed run's cgroup %s is still there", dir)
		}
	}
	if data, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(data), e.runDir+"/sandboxes/") {
		t.Errorf("host mounts of the killed run remain")
	}
}

func dirNames(dir string) []string {
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, d := range ents {
		names = append(names, d.Name())
	}
	return names
}

// A reader that stops early (`cage run -- cmd | head`) must not leave the
// sandbox behind: cage ends as a filter does (128+SIGPIPE) and cleans up.
func TestStdoutClosedEarly(t *testing.T) {
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := e.command(ctx, "run", "--timeout", "30s", "--", "sh", "-c", "echo READY; exec yes")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var errb bytes.Buffer
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop := e.watchIDs()
	buf := make([]byte, 4096)
	if _, err := io.ReadFull(stdout, buf); err != nil {
		t.Fatalf("read the command's output: %v", err)
	}
	stdout.Close() // as head does after its first lines
	start := time.Now()
	err = cmd.Wait()
	ids := stop()
	var ee *exec.ExitError
	code := -1
	switch {
	case err == nil:
		code = 0
	case errors.As(err, &ee):
		code = ee.ExitCode()
		if ws := ee.Sys().(syscall.WaitStatus); ws.Signaled() {
			code = 128 + int(ws.Signal())
		}
	default:
		t.Fatalf("wait for cage: %v", err)
	}
	t.Logf("stdout closed early: cage ended %v later with %d, stderr %q, sandboxes %v", time.Since(start).Round(time.Millisecond), code, errb.String(), ids)
	if code != 128+int(syscall.SIGPIPE) {
		t.Errorf("stdout closed early: exit %d, want %d (SIGPIPE, as a filter ends)", code, 128+int(syscall.SIGPIPE))
	}
	if time.Since(start) > 20*time.Second {
		t.Errorf("cage kept running %v after its stdout was closed", time.Since(start))
	}
	noPanic(t, errb.String())
	if len(ids) == 0 {
		t.Errorf("never saw the sandbox in %s/sandboxes", e.runDir)
	}
	e.noLeftovers(ids...)
	removeLeftovers(e, ids)
}

// removeLeftovers removes what a failed cleanup left, so that one product
// bug does not spill into later tests or the host.
func removeLeftovers(e *env, ids []string) {
	for _, id := range ids {
		for _, dir := range cageCgroups()[id] {
			_ = syscall.Rmdir(dir)
		}
	}
	for _, sub := range []string{"sandboxes", "ids"} {
		for _, name := range dirNames(filepath.Join(e.runDir, sub)) {
			_ = os.RemoveAll(filepath.Join(e.runDir, sub, name))
		}
	}
}

// --tty always with stdin that is not a terminal: the command gets a PTY,
// and the end of the input still reaches it, so `cat` ends.
func TestTTYAlwaysWithPipedStdin(t *testing.T) {
	e := setup(t)
	r := e.cage(strings.NewReader("hi\n"), "run", "--tty", "always", "--timeout", "8s", "--", "cat")
	if r.code != 0 || !strings.Contains(r.stdout, "hi") {
		t.Errorf("echo hi | cage run --tty always -- cat: %v; want exit 0 once the input ends", r)
	}
	r = e.cage(nil, "run", "--tty", "always", "--", "sh", "-c", "test -t 0 && test -t 1 && echo TTY; stty size")
	if r.code != 0 || r.stdout != "TTY\r\n24 80\r\n" {
		t.Errorf("--tty always without a terminal: %v; want a 24x80 PTY", r)
	}
	e.noLeftovers(r.ids...)
}

// TestInheritedDescriptorsStayOutside: a descriptor cage inherits from its
// caller (here an open file holding a secret, as fd 3) must not reach the
// sandbox's agent or commands.
func TestInheritedDescriptorsStayOutside(t *testing.T) {
	e := setup(t)
	secretFile := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secretFile, []byte("inherited-secret\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(secretFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := e.command(ctx, "run", "--", "python3", "-c",
		`import os; print(sorted(int(f) for f in os.listdir("/proc/self/fd")))
for fd in range(3, 300):
    try:
        print(os.pread(fd, 100, 0))
    except OSError:
        pass`)
	cmd.ExtraFiles = []*os.File{f}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cage: %v: %s", err, out)
	}
	if strings.Contains(string(out), "inherited-secret") || !strings.HasPrefix(string(out), "[0, 1, 2, 3]\n") {
		t.Errorf("the command saw descriptors beyond its own stdio (3 is the listing's): %q", out)
	}
	e.noLeftovers()
}

// TestOneShotStdioArePipes: cage run without a terminal makes the sandbox
// for its command, which runs on pipes cage made and copies: with cage's
// own stdin and stdout files of the host (world-writable even), the
// command holds pipes, never those files, and reopening its descriptors
// through /proc reaches no host file. Output and input still pass.
func TestOneShotStdioArePipes(t *testing.T) {
	e := setup(t)
	dir := t.TempDir()
	in, outPath := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	if err := os.WriteFile(in, []byte("host-input\n"), 0o666); err != nil {
		t.Fatal(err)
	}
	stdin, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := os.OpenFile(outPath, os.O_CREATE|os.O_WRONLY, 0o666)
	if err != nil {
		t.Fatal(err)
	}
	defer stdout.Close()
	if err := os.Chmod(outPath, 0o666); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := e.command(ctx, "run", "--", "sh", "-c", `for fd in 0 1 2; do echo "$fd $(readlink /proc/self/fd/$fd)"; done
echo reopened > /proc/self/fd/1
read line; echo "read: $line"`)
	cmd.Stdin, cmd.Stdout = stdin, stdout
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("cage: %v: %s", err, stderr.String())
	}
	out, err := os.ReadFile(outPath)
	if err != nil {
		t.Fatal(err)
	}
	// Reopening /proc/self/fd/1 reaches the pipe at most (root's on the
	// host, so the sandbox's user may not open it): never the file, whose
	// start the listing would then have been written over.
	if !regexp.MustCompile(`^0 pipe:\[\d+\]\n1 pipe:\[\d+\]\n2 pipe:\[\d+\]\n(reopened\n)?read: host-input\n$`).Match(out) {
		t.Errorf("the command's output, or its input, did not pass through cage's pipes: %q", out)
	}
	e.noLeftovers()
}

// TestOneShotSudo: on cage run's one-shot path the agent serves sudo
// (@cage/sudo) as on the usual one, bound before the command exists: root
// (or the group sudo) gets a command run as another account, and the
// command cannot bind the name itself. Before (a review, 2026-12-03), the
// one-shot agent never bound it: sudo said "Connection refused", and any
// user of the sandbox could take the name and answer sudo requests itself.
func TestOneShotSudo(t *testing.T) {
	e := setup(t)
	client, err := os.ReadFile("../../templates/base/sudo")
	if err != nil {
		t.Fatal(err)
	}
	r := e.cage(bytes.NewReader(client), "run", "--user", "root", "--", "python3", "-", "-u", "user", "id", "-un")
	if r.code != 0 || r.stdout != "user\n" {
		t.Errorf("sudo -u user id -un as root, one-shot: %v; want user", r)
	}
	r = e.cage(nil, "run", "--", "python3", "-c", `import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.bind("\0cage/sudo"); print("BOUND")
except OSError as e:
    print(e.errno)`)
	if r.code != 0 || r.stdout != "98\n" {
		t.Errorf("binding @cage/sudo from the command: %v; want EADDRINUSE (98)", r)
	}
	e.noLeftovers(r.ids...)
}

// TestLongCommandNotFound: a command that does not exist is 127 with one
// line whatever its name's length, on the one-shot path as with --copy-in.
// Before (a review, 2026-12-03), a 4 KiB name made the one-shot agent's
// report longer than cage reads: "agent exited (status 0)", exit 125.
func TestLongCommandNotFound(t *testing.T) {
	e := setup(t)
	name := strings.Repeat("a", 4100)
	for _, args := range [][]string{{"run", "--", name}, {"run", "--copy-in", t.TempDir() + ":/tmp/in", "--", name}} {
		r := e.cage(nil, args...)
		if r.code != 127 || !strings.HasPrefix(r.stderr, "cage: aaaa") {
			t.Errorf("%.40q: exit %d, stderr %.100q; want 127 and cage's line", args, r.code, r.stderr)
		}
		oneLine(t, "long name not found", r.stderr)
	}
	e.noLeftovers()
}

// TestLargeCommand: a command whose arguments pass 1 MiB (ten of 120 KB,
// under the kernel's 128 KiB a string) runs, as the RPC path always ran
// it: the one-shot path would put it in the sandbox's first document,
// read to 1 MiB, so past wall.MaxRunSize cage takes the RPC path. Before
// (a review, 2026-12-03), "send the sandbox spec: broken pipe", exit 125.
func TestLargeCommand(t *testing.T) {
	e := setup(t)
	arg := strings.Repeat("a", 120_000)
	args := []string{"run", "--", "sh", "-c", `echo "$# ${#1}"`, "sh"}
	for range 10 {
		args = append(args, arg)
	}
	r := e.cage(nil, args...)
	if r.code != 0 || r.stdout != "10 120000\n" {
		t.Errorf("ten arguments of 120 KB: exit %d, stdout %q, stderr %.200q", r.code, r.stdout, r.stderr)
	}
	e.noLeftovers(r.ids...)
}

// TestHostUsersCannotReachSandboxFiles: the host mounts some of a
// sandbox's files under its state directory (an image template's overlay
// on the process wall, the OCI walls' disk and root): another user of the
// host can neither list that directory nor read or plant a file there,
// while the sandbox runs (before, they were world-traversable: a host
// user read what a tenant kept in /tmp, and planted files it then saw).
func TestHostUsersCannotReachSandboxFiles(t *testing.T) {
	for _, c := range []struct {
		wall, template string
		mounted        bool // its /tmp is mounted on the host, under the state directory
	}{{"process", "bb", true}, {"runc", "", true}, {"gvisor", "", false}} {
		t.Run(c.wall, func(t *testing.T) {
			e := setup(t)
			if c.wall != "process" {
				bin := map[string]string{"runc": "runc", "gvisor": "runsc"}[c.wall]
				if _, err := exec.LookPath(bin); err != nil && os.Getenv("CAGE_RUNSC") == "" {
					testutil.SkipWall(t, c.wall, "%s not installed", bin)
				}
			}
			var env []string
			args := []string{"run", "--wall", c.wall}
			if c.template != "" {
				env, _ = buildEnv(t, e)
				args = append(args, "--template", c.template)
			}
			args = append(args, "--", "sh", "-c", "echo TENANT-SECRET > /tmp/secret; echo READY; sleep 30")
			l := e.startCageEnv(env, args...)
			defer func() {
				_ = l.cmd.Process.Signal(os.Interrupt)
				l.wait(t)
				e.noLeftovers()
			}()
			ids := dirNames(filepath.Join(e.runDir, "sandboxes"))
			if len(ids) != 1 {
				t.Fatalf("RUN_DIR/sandboxes holds %v, want one sandbox", ids)
			}
			dir := filepath.Join(e.runDir, "sandboxes", ids[0])
			var found []string // where the host sees the sandbox's file (as root)
			_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.Name() == "secret" && !d.IsDir() {
					found = append(found, p)
				}
				return nil
			})
			if c.mounted && len(found) == 0 {
				t.Fatalf("the sandbox's /tmp/secret is nowhere under %s: this test would prove nothing", dir)
			}
			asNobody := func(name string, arg ...string) (string, error) {
				cmd := exec.Command(name, arg...)
				cmd.Dir = "/"
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
				out, err := cmd.CombinedOutput()
				return string(out), err
			}
			if out, err := asNobody("ls", dir); err == nil {
				t.Errorf("a host user listed the sandbox's state directory: %q", out)
			}
			for _, p := range found {
				if out, err := asNobody("cat", p); err == nil || strings.Contains(out, "TENANT-SECRET") {
					t.Errorf("a host user read the sandbox's %s: %q", p, out)
				}
				planted := filepath.Join(filepath.Dir(p), "planted")
				if out, err := asNobody("sh", "-c", "echo from-the-host > "+planted); err == nil {
					t.Errorf("a host user wrote %s: %q", planted, out)
				}
			}
		})
	}
}

// TestSandboxOwnsItsUserNamespace: the kernel charges per-user counts
// (inotify instances, queued signals, ...) at the host's level to a user
// namespace's owner. A sandbox's is its own root's host uid, not host
// root's: seen from inside, its namespace's owner is its root (uid 0), and
// a sandbox that holds every inotify instance it may leaves host root and
// another sandbox theirs. (Before, every sandbox's namespace was root's:
// one sandbox, as its unprivileged user, took root's 128 instances, and
// inotify failed on the host and in every sandbox until it let go.)
func TestSandboxOwnsItsUserNamespace(t *testing.T) {
	for _, wall := range []string{"process", "runc"} {
		t.Run(wall, func(t *testing.T) {
			e := setup(t)
			if wall == "runc" {
				if _, err := exec.LookPath("runc"); err != nil {
					testutil.SkipWall(t, wall, "runc not installed")
				}
			}
			// With a network too: runc joins the user namespace first, and
			// then only namespaces it owns.
			for _, net := range []string{"none", "allowlist"} {
				r := e.cage(nil, "run", "--wall", wall, "--net", net, "--", "python3", "-c", `import array, fcntl, os
b = array.array("I", [0])
fcntl.ioctl(os.open("/proc/self/ns/user", os.O_RDONLY), 0xb704, b)  # NS_GET_OWNER_UID
print(b[0])`)
				if r.code != 0 || r.stdout != "0\n" {
					t.Errorf("--net %s: the sandbox's user namespace's owner, seen inside: %v; want 0, its own root (65534: a host uid it cannot see)", net, r)
				}
			}
			l := e.startCage("run", "--wall", wall, "--", "python3", "-c", `import ctypes, sys, time
libc = ctypes.CDLL(None)
n = 0
while libc.inotify_init() >= 0:
    n += 1
print("READY", flush=True)
print(n, flush=True)
time.sleep(30)`)
			defer func() {
				_ = l.cmd.Process.Signal(os.Interrupt)
				l.wait(t)
				e.noLeftovers()
			}()
			deadline := time.Now().Add(20 * time.Second)
			for strings.Count(l.output(), "\n") < 2 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			held, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(l.output(), "READY\n")))
			if held < 64 {
				t.Fatalf("the sandbox held %d inotify instances (%q): this test would prove nothing", held, l.output())
			}
			fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
			if err != nil {
				t.Errorf("host root's inotify_init while a sandbox holds %d instances: %v", held, err)
			} else {
				unix.Close(fd)
			}
			r := e.cage(nil, "run", "--wall", wall, "--", "python3", "-c", `import ctypes; print(ctypes.CDLL(None).inotify_init() >= 0)`)
			if r.code != 0 || r.stdout != "True\n" {
				t.Errorf("another sandbox's inotify_init while the first holds %d instances: %v", held, r)
			}
		})
	}
}
