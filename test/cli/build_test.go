package clitest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// buildEnv is a data directory with the test image imported as "bb", and a
// build context.
func buildEnv(t *testing.T, e *env) (env []string, ctxDir string) {
	data := t.TempDir()
	env = []string{"CAGE_DATA=" + data}
	tarPath := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")
	if r := e.cageEnv(nil, env, "template", "import", tarPath, "bb"); r.code != 0 {
		t.Fatalf("import: %v", r)
	}
	ctxDir = t.TempDir()
	must(t, os.WriteFile(filepath.Join(ctxDir, "hello.txt"), []byte("world\n"), 0o644))
	must(t, os.MkdirAll(filepath.Join(ctxDir, "app", "lib"), 0o755))
	must(t, os.WriteFile(filepath.Join(ctxDir, "app", "run.sh"), []byte("#!/bin/sh\necho app ran\n"), 0o755))
	must(t, os.WriteFile(filepath.Join(ctxDir, "app", "lib", "data"), []byte("data\n"), 0o600))
	return env, ctxDir
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

const testDockerfile = `# every instruction cage builds
ARG GREETING=hello
FROM bb
ARG GREETING
ENV APP=/opt/app \
    MODE="two words"
WORKDIR /opt/app
COPY hello.txt ./
COPY --chown=1000:1000 app /opt/app/
RUN echo "$GREETING $(cat hello.txt)" > out.txt && rm /etc/os-release && \
    mkdir -p /var/owned && chown 1000:1000 /var/owned && ln -s /etc/passwd /opt/app/link && \
    (sleep 30 &) && echo step ran
USER 1000
LABEL org.cage.built=yes
CMD ["/bin/sh"]
`

// TestTemplateBuild: a Dockerfile of every instruction builds a template
// whose sandboxes see its files, owners, deletions and settings; building
// it again runs nothing; a changed input re-runs only what depends on it.
func TestTemplateBuild(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(testDockerfile), 0o644))

	r := e.cageEnv(nil, env, "template", "build", "--build-arg", "GREETING=hi", ctxDir, "built")
	if r.code != 0 || !strings.Contains(r.stderr, "step ran") || !strings.Contains(r.stderr, "step 11/11") {
		t.Fatalf("template build: %v", r)
	}
	e.noLeftovers(r.ids...)
	id := builtID(t, r.stdout)
	checks := []struct{ script, want string }{
		{"cat /opt/app/out.txt", "hi world\n"},
		{"test -e /etc/os-release && echo present || echo deleted", "deleted\n"},
		{"stat -c '%u %a' /var/owned /opt/app/run.sh /opt/app/lib/data /opt/app/hello.txt", "1000 755\n1000 755\n1000 600\n0 644\n"},
		{"/opt/app/run.sh", "app ran\n"},
		{"readlink /opt/app/link", "/etc/passwd\n"},
		{"echo \"$APP|$MODE\"", "/opt/app|two words\n"},
		{"ls /run/cage/ | wc -l; cat /etc/hostname | cut -c1-5", "3\ncage-\n"},
	}
	for _, c := range checks {
		r := e.cageEnv(nil, env, "run", "--template", "built", "--", "sh", "-c", c.script)
		if r.code != 0 || r.stdout != c.want {
			t.Errorf("in the built template: %q: %v; want stdout %q", c.script, r, c.want)
		}
	}
	r = e.cageEnv(nil, env, "template", "inspect", "built")
	for _, want := range []string{`"org.cage.built": "yes"`, `"workingDir": "/opt/app"`, `"user": "1000"`, `"MODE=two words"`} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("template inspect built: no %s in\n%s", want, r.stdout)
		}
	}

	// Again: every step from the cache, the same template.
	r = e.cageEnv(nil, env, "template", "build", "--build-arg", "GREETING=hi", ctxDir, "built")
	if r.code != 0 || strings.Contains(r.stderr, "step ran") || strings.Count(r.stderr, "cached") != 3 || builtID(t, r.stdout) != id {
		t.Errorf("second build: %v; want the 3 COPY/RUN steps cached, nothing run, template %s", r, id)
	}
	// A changed file re-runs its COPY and what follows, not the COPY before.
	must(t, os.WriteFile(filepath.Join(ctxDir, "app", "run.sh"), []byte("#!/bin/sh\necho changed\n"), 0o755))
	r = e.cageEnv(nil, env, "template", "build", "--build-arg", "GREETING=hi", ctxDir, "built")
	if r.code != 0 || !strings.Contains(r.stderr, "step ran") || strings.Count(r.stderr, "cached") != 1 {
		t.Errorf("build after a change: %v; want the first COPY cached, the rest run", r)
	}
	// --no-cache runs everything.
	r = e.cageEnv(nil, env, "template", "build", "--no-cache", "--build-arg", "GREETING=hi", ctxDir, "built")
	if r.code != 0 || !strings.Contains(r.stderr, "step ran") || strings.Contains(r.stderr, "cached") {
		t.Errorf("build --no-cache: %v", r)
	}
	e.noLeftovers(r.ids...)
}

var builtRE = regexp.MustCompile(`^built ([0-9a-f]{12}) `)

func builtID(t *testing.T, stdout string) string {
	m := builtRE.FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("build printed %q, want `built ID (...)`", stdout)
	}
	return m[1]
}

// TestTemplateBuildNetwork: a RUN step reaches the (test world's) internet
// only when the build asks for it, and the build says so.
func TestTemplateBuildNetwork(t *testing.T) {
	e := setup(t)
	w := testutil.SharedWorld(t)
	env, ctxDir := buildEnv(t, e)
	env = append(env, "CAGE_DNS="+strings.Join(w.Upstreams(), ","))
	// busybox's wget crashes (Debian 12's busybox-static); nc speaks HTTP.
	df := "FROM bb\nRUN printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 " + testutil.PublicHost.String() + " 80 > /fetched && grep public /fetched\n"
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(df), 0o644))
	r := e.cageEnv(nil, env, "template", "build", ctxDir, "offline")
	if r.code != 1 || !strings.Contains(r.stderr, "build failed") || strings.Contains(r.stderr, "with network") {
		t.Errorf("a RUN that needs the network, without --net: %v; want exit 1, build failed", r)
	}
	r = e.cageEnv(nil, env, "template", "build", "--net", "internet", ctxDir, "online")
	if r.code != 0 || !strings.Contains(r.stderr, "with network: internet") || !strings.Contains(r.stderr, "public") {
		t.Errorf("with --net internet: %v", r)
	}
	e.noLeftovers(r.ids...)
}

// TestBuildStepCannotTakeOverAgent: a RUN step runs as root with the
// capabilities a build needs (CAP_SETUID among them). A hostile step that
// takes the agent's uid and keeps them still cannot open the agent's
// memory: the agent holds a capability no command can have, so the
// kernel refuses the access (before, it opened /proc/1/mem for writing,
// which is the agent's code and the uid-range lock it holds).
func TestBuildStepCannotTakeOverAgent(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	probe := filepath.Join(ctxDir, "agentpeek")
	cmd := exec.Command("go", "build", "-trimpath", "-o", probe, "./testdata/agentpeek")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build agentpeek: %v\n%s", err, out)
	}
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM bb\nCOPY agentpeek /agentpeek\nRUN /agentpeek\n"), 0o644))
	r := e.cageEnv(nil, env, "template", "build", "--no-cache", ctxDir, "peek")
	if r.code != 0 {
		t.Fatalf("build: %v", r)
	}
	e.noLeftovers(r.ids...)
	if !strings.Contains(r.stderr, "as the agent's uid") {
		t.Fatalf("the step did not reach the agent's uid with its capabilities (the test proves nothing): %v", r)
	}
	if !strings.Contains(r.stderr, "agent memory: refused (permission denied)") {
		t.Errorf("a build step as the agent's uid: %v; want its memory refused", r)
	}
}

// TestTemplateBuildBadInput: one line, the right code, nothing left.
func TestTemplateBuildBadInput(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	write := func(name, body string) string {
		p := filepath.Join(ctxDir, name)
		must(t, os.WriteFile(p, []byte(body), 0o644))
		return p
	}
	fifo := filepath.Join(ctxDir, "fifo")
	must(t, syscall.Mkfifo(fifo, 0o644))
	for _, c := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unsupported instruction", []string{"-f", write("d1", "FROM bb\nHEALTHCHECK CMD true\n"), ctxDir, "x"}, 1, "line 2: HEALTHCHECK is not supported"},
		{"no FROM", []string{"-f", write("d2", "RUN true\n"), ctxDir, "x"}, 1, "first instruction must be FROM"},
		{"second FROM", []string{"-f", write("d3", "FROM bb\nFROM bb\n"), ctxDir, "x"}, 1, "multi-stage"},
		{"unknown base", []string{"-f", write("d4", "FROM nope\n"), ctxDir, "x"}, 1, `"nope"`},
		{"failing RUN", []string{"-f", write("d5", "FROM bb\nRUN echo out; exit 3\n"), ctxDir, "x"}, 1, "exit code 3"},
		{"COPY out of the context", []string{"-f", write("d6", "FROM bb\nCOPY ../../etc/passwd /x\n"), ctxDir, "x"}, 1, "not in the build context"},
		{"COPY a URL", []string{"-f", write("d7", "FROM bb\nADD http://example.com/x /x\n"), ctxDir, "x"}, 1, "only files of the build context"},
		{"named chown", []string{"-f", write("d8", "FROM bb\nCOPY --chown=user hello.txt /x\n"), ctxDir, "x"}, 1, "numeric ids"},
		{"context not a directory", []string{filepath.Join(ctxDir, "hello.txt"), "x"}, 64, "not a directory"},
		{"no Dockerfile", []string{"-f", "/no/such/Dockerfile", ctxDir, "x"}, 64, "/no/such/Dockerfile"},
		{"Dockerfile a FIFO", []string{"-f", fifo, ctxDir, "x"}, 64, "not a regular file"},
		{"bad --net", []string{"--net", "allowlist", ctxDir, "x"}, 64, "--net"},
		{"bad --build-arg", []string{"--build-arg", "NOEQUALS", ctxDir, "x"}, 64, "--build-arg"},
		{"bad name", []string{"-f", write("d9", "FROM bb\n"), ctxDir, "../x"}, 64, "../x"},
	} {
		r := e.cageEnv(nil, env, append([]string{"template", "build"}, c.args...)...)
		last := strings.TrimSpace(r.stderr)
		if i := strings.LastIndex(last, "\n"); i >= 0 {
			last = last[i+1:]
		}
		if r.code != c.code || !strings.HasPrefix(last, "cage: ") || !strings.Contains(last, c.want) {
			t.Errorf("%s: %v; want exit %d and a last line naming %q", c.name, r, c.code, c.want)
		}
		e.noLeftovers(r.ids...)
	}
	if r := e.cageEnv(nil, env, "template", "inspect", "x"); r.code != 66 {
		t.Errorf("a failed build left template x: %v", r)
	}
}

// TestTemplateStartCommand: a template's start command (label cage.start)
// runs when a sandbox starts, and the create waits for its ready check
// (cage.ready); one that never gets ready fails the create, leaving nothing.
func TestTemplateStartCommand(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(`FROM bb
LABEL cage.start="sleep 0.3; echo up > /tmp/ready; exec sleep 1000" cage.ready="test -f /tmp/ready"
`), 0o644))
	if r := e.cageEnv(nil, env, "template", "build", ctxDir, "svc"); r.code != 0 {
		t.Fatalf("build: %v", r)
	}
	r := e.cageEnv(nil, env, "run", "--template", "svc", "--", "sh", "-c", "cat /tmp/ready; ps -o args | grep -c '^sleep 1000'")
	if r.code != 0 || r.stdout != "up\n1\n" {
		t.Errorf("the first command of a sandbox of svc: %v; want the service up and running", r)
	}
	e.noLeftovers(r.ids...)
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte(`FROM bb
LABEL cage.start="sleep 1000" cage.ready="false" cage.ready-timeout="1"
`), 0o644))
	if r := e.cageEnv(nil, env, "template", "build", ctxDir, "never"); r.code != 0 {
		t.Fatalf("build: %v", r)
	}
	r = e.cageEnv(nil, env, "run", "--template", "never", "--", "true")
	if r.code != 125 || !strings.Contains(r.stderr, "not ready after 1s") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
		t.Errorf("a template that never gets ready: %v; want exit 125, one line", r)
	}
	e.noLeftovers(r.ids...)
}

// TestTemplateBuildStepTimeout: a RUN step that runs past the build's step
// time limit (--step-timeout) is killed with its sandbox, and the build
// fails with one line naming the limit, leaving no sandbox, layer file or
// template behind. Before, a step ran as long as it liked.
func TestTemplateBuildStepTimeout(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	tmp := t.TempDir()
	env = append(env, "TMPDIR="+tmp)
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM bb\nRUN echo step started; touch /made; sleep 1000\n"), 0o644))
	r := e.cageEnv(nil, env, "template", "build", "--step-timeout", "2s", ctxDir, "slow")
	last := strings.TrimSpace(r.stderr)
	if i := strings.LastIndex(last, "\n"); i >= 0 {
		last = last[i+1:]
	}
	if r.code != 1 || !strings.Contains(r.stderr, "step started") || !strings.HasPrefix(last, "cage: build failed") ||
		!strings.Contains(last, "ran past its time limit of 2s") {
		t.Errorf("a RUN step past --step-timeout 2s: %v; want exit 1 and a last line naming the limit", r)
	}
	if r.took > 60*time.Second {
		t.Errorf("the step was stopped after %v, not at its limit", r.took)
	}
	e.noLeftovers(r.ids...)
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("the timed-out build left %d files in its temporary directory: %v", len(left), left)
	}
	if r := e.cageEnv(nil, env, "template", "inspect", "slow"); r.code != exitNoTemplate {
		t.Errorf("a timed-out build made its template: %v", r)
	}
	for _, bad := range []string{"0", "-1s", "soon", "1000h"} {
		r := e.cageEnv(nil, env, "template", "build", "--step-timeout", bad, ctxDir, "slow")
		if r.code != exitUsage || !strings.Contains(r.stderr, "--step-timeout") {
			t.Errorf("--step-timeout %s: %v; want a usage error naming the flag", bad, r)
		}
	}
}

// TestTemplateBuildInterrupt: Ctrl-C during a RUN step stops the build,
// destroys the step's sandbox and removes what the build had staged:
// cage exits 130 with one line. Before, SIGINT killed cage where it stood
// and the step's sandbox was left to whoever came next.
func TestTemplateBuildInterrupt(t *testing.T) {
	e := setup(t)
	env, ctxDir := buildEnv(t, e)
	tmp := t.TempDir()
	must(t, os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM bb\nRUN echo step started; sleep 1000\n"), 0o644))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := e.command(ctx, "template", "build", ctxDir, "interrupted")
	cmd.Env = append(cmd.Env, env...)
	cmd.Env = append(cmd.Env, "TMPDIR="+tmp)
	stderr, err := cmd.StderrPipe()
	must(t, err)
	stop := e.watchIDs()
	must(t, cmd.Start())
	var out bytes.Buffer
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
		if sc.Text() == "step started" {
			break
		}
	}
	must(t, cmd.Process.Signal(os.Interrupt))
	start := time.Now()
	rest, _ := io.ReadAll(stderr)
	out.Write(rest)
	code := exitCodeOf(t, cmd.Wait())
	took := time.Since(start)
	ids := stop()
	t.Logf("SIGINT during a RUN step: exit %d after %v, stderr %q", code, took.Round(time.Millisecond), out.String())
	noPanic(t, out.String())
	if code != 128+int(syscall.SIGINT) || !strings.HasSuffix(out.String(), "cage: interrupted; the build stopped and its step's sandbox was destroyed\n") {
		t.Errorf("SIGINT during a RUN step: exit %d, stderr %q; want %d and one line saying so", code, out.String(), 128+int(syscall.SIGINT))
	}
	if took > 30*time.Second {
		t.Errorf("the build took %v to stop", took)
	}
	if len(ids) == 0 {
		t.Fatal("no step sandbox was seen: the test proves nothing")
	}
	e.noLeftovers(ids...)
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("the interrupted build left %d files in its temporary directory: %v", len(left), left)
	}
}
