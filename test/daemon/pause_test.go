package daemontest

import (
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil"
)

// counter starts a process that writes 1, 2, 3... to /tmp/count ten times
// a second, in the background.
//
// It is its own group: in "A && B && counter", a bare trailing & would put the
// whole and-or list in the background, and a test would pause or fork while
// A and B still ran (a checksum file found empty after a pause).
// It returns once the counter has written its first count (on a loaded
// host the background shell may not have run yet when the command ends),
// or after 5 s without one, for the test's next read to fail on.
// The wait is inside the group, so that a failing A still fails the command.
const counter = `{ nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done' >/dev/null 2>&1 & n=0; until [ -e /tmp/count ] || [ $n -ge 500 ]; do n=$((n+1)); sleep 0.01; done; };`

func count(t *testing.T, out string) int {
	t.Helper()
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("count %q: %v", out, err)
	}
	return n
}

// TestPauseWithMemory: a paused sandbox keeps its processes and memory:
// its state says paused, a second pause is 409, traffic to it finds
// nothing (no auto-resume), connect resumes it (201) and the counter goes
// on from where it stood, not from where time alone would have taken it;
// connect of a running sandbox is 200. Ten cycles later it still works.
func TestPauseWithMemory(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	mustRun(t, ac, "echo kept > /home/user/file; "+counter)
	time.Sleep(500 * time.Millisecond)

	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{}})
	paused := d.get(t, d.key, id)
	if paused.State != "paused" || paused.PausedWith != "memory" {
		t.Errorf("after pause: state %q, pausedWith %q; want paused, memory", paused.State, paused.PausedWith)
	}
	d.expect(t, http.StatusConflict, call{method: "POST", path: path + "/pause", key: d.key})
	r := d.proxyGet(t, "/envs", map[string]string{"E2b-Sandbox-Id": id, "X-Access-Token": sb.EnvdAccessToken}, "")
	checkProxyError(t, r, id, "The sandbox was not found")
	// Frozen: the counter, read through the host, does not move.
	v0 := count(t, readFrozenCount(t, d, id))
	time.Sleep(1500 * time.Millisecond)
	if v := count(t, readFrozenCount(t, d, id)); v != v0 {
		t.Errorf("the counter of a paused sandbox moved from %d to %d", v0, v)
	}

	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 300}})
	v1 := count(t, mustRun(t, ac, "cat /tmp/count"))
	if v1 < v0 || v1 > v0+5 {
		t.Errorf("after resume the counter reads %d; it stood at %d when paused (1.5 s paused would be +15 had it run)", v1, v0)
	}
	time.Sleep(500 * time.Millisecond)
	if v2 := count(t, mustRun(t, ac, "cat /tmp/count")); v2 <= v1 {
		t.Errorf("the counter does not go on after resume: %d then %d", v1, v2)
	}
	if got := d.get(t, d.key, id); got.State != "running" || got.PausedWith != "" {
		t.Errorf("after resume: state %q pausedWith %q", got.State, got.PausedWith)
	}
	d.expect(t, http.StatusOK, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{}})
	for i := 0; i < 10; i++ {
		d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
		d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key})
	}
	if out := mustRun(t, ac, "cat /home/user/file"); out != "kept\n" {
		t.Errorf("after 11 pause/resume cycles: %q", out)
	}
	if _, err := os.Stat(filepath.Join(d.data, "paused", id+".tar")); err == nil {
		t.Errorf("a resumed sandbox's saved files were left on disk")
	}
}

// readFrozenCount reads /tmp/count of a paused sandbox: its agent is
// frozen, so through the host's view of the sandbox's disk (the process
// wall with the host template keeps it in the agent's mount namespace).
func readFrozenCount(t *testing.T, d *daemon, id string) string {
	t.Helper()
	pid := agentOf(t, id)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/root/tmp/count", pid))
	if err != nil {
		t.Fatalf("read the paused sandbox's counter: %v", err)
	}
	return string(b)
}

// TestPauseFilesOnly: memory false saves the sandbox's files and releases
// everything else: no agent runs while paused, connect starts it again
// with the same id and token from its files (owners and modes kept), and
// its processes are gone. A paused sandbox survives kill -9 of the daemon
// and the loss of everything on the host but the data directory (a host
// restart: every sandbox process killed, the run directory cleared).
func TestPauseFilesOnly(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	mustRun(t, ac, "mkdir -p /home/user/proj && echo 'print(42)' > /home/user/proj/main.py && chmod 750 /home/user/proj && "+
		"head -c 3000000 /dev/urandom > /tmp/blob && sha256sum /tmp/blob > /home/user/sum && "+counter)
	agent := agentOf(t, id)
	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{"memory": false}})
	if got := d.get(t, d.key, id); got.State != "paused" || got.PausedWith != "files" {
		t.Errorf("after pause: state %q pausedWith %q", got.State, got.PausedWith)
	}
	if eventually(5*time.Second, func() string {
		if _, ok := readProc(agent); ok {
			return "alive"
		}
		return ""
	}) != "" {
		t.Errorf("the agent of a sandbox paused without memory still runs")
	}
	d.checkGone(t, id, 5*time.Second)

	// A host restart: the daemon killed, nothing left in /run.
	d.kill9(t)
	forceRemoveSandboxes(d.runDir)
	d.start(t)
	if got := d.get(t, d.key, id); got.State != "paused" {
		t.Fatalf("after a host restart: state %q, want paused", got.State)
	}
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 120}})
	ac2 := d.agent(id, sb.EnvdAccessToken)
	defer ac2.Close()
	out := mustRun(t, ac2, "cat /home/user/proj/main.py; stat -c '%a %U' /home/user/proj; sha256sum -c /home/user/sum >/dev/null && echo same; pgrep -f '[c]ount.new' || echo no-counter")
	if out != "print(42)\n750 user\nsame\nno-counter\n" {
		// What was there, to tell a lost file from a changed one.
		diag := run(ac2, "ls -l /tmp /home/user; cat /home/user/sum; sha256sum /tmp/blob 2>&1")
		t.Errorf("after resume from files: %q\n%s%s", out, diag.stdout, diag.stderr)
	}
	if got := d.get(t, d.key, id); got.State != "running" || got.EnvdAccessToken != sb.EnvdAccessToken {
		t.Errorf("after resume: %+v", got)
	}
}

// TestPauseFilesEveryWall: a pause without memory and its resume keep,
// on every wall present and for the host template (its /home and /tmp)
// and the base image (its writable root; the microvm walks the root's
// upper layer), what a sandbox can make: a tree deeper than PATH_MAX
// (4,096 bytes, which a walk by paths cannot name: its bottom was left
// out without a word), a 1 MiB file, and a file in a directory made after
// it, mode 600 (the microvm lost those once its archive's walk lost the
// descriptor it went through).
func TestPauseFilesEveryWall(t *testing.T) {
	t.Parallel()
	templates := []string{"host"}
	if os.Getenv("CAGE_TEMPLATES") != "" {
		templates = append(templates, "base")
	}
	d := startDaemon(t, "--config", templatesConfig(t))
	// 26 directories of 200-byte names: a 5,226-byte path, made and read
	// from each directory in turn (a shell's cd names its whole path).
	const deep = `python3 -c "import os; os.chdir('/home/user'); n = 'd' * 200
for _ in range(26):
    `
	for _, tmpl := range templates {
		for _, w := range []string{"process", "runc", "gvisor", "microvm"} {
			if w == "microvm" && tmpl != "base" {
				continue // the microvm runs images only
			}
			if !wallHere(w) {
				if testutil.WallRequired(w) {
					t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but is not on this host", w)
				}
				t.Logf("SKIP wall %s: not on this host", w)
				continue
			}
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 300})
			id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
			ac := d.agent(id, sb.EnvdAccessToken)
			mustRun(t, ac, "cd /home/user && head -c 1048576 /dev/urandom > big && sha256sum big > big.sum && "+
				"mkdir -p dir/sub && echo kept > dir/sub/f && chmod 600 dir/sub/f && "+
				deep+`os.mkdir(n); os.chdir(n)
open('bottom.txt', 'w').write('deep\\n')"`)
			ac.Close()
			d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{"memory": false}})
			d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 120}})
			ac = d.agent(id, sb.EnvdAccessToken)
			r := run(ac, "cd /home/user && sha256sum -c big.sum >/dev/null && echo big; cat dir/sub/f; stat -c '%a %U' dir/sub/f; "+
				deep+`os.chdir(n)
print(open('bottom.txt').read(), end='')"`)
			if want := "big\nkept\n600 user\ndeep\n"; r.stdout != want {
				t.Errorf("%s on %s, after a pause without memory: %q (stderr %q, exit %d), want %q", tmpl, w, r.stdout, r.stderr, r.exit, want)
			} else {
				t.Logf("%s on %s: every file came back", tmpl, w)
			}
			ac.Close()
			d.kill(t, d.key, id)
		}
	}
}

// TestPauseBadInput: pause and resume of what cannot be paused or resumed.
func TestPauseBadInput(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600})
	path := "/sandboxes/" + sb.SandboxID
	other := d.createKey(t, "other")
	d.expect(t, http.StatusNotFound, call{method: "POST", path: path + "/pause", key: other})
	d.expect(t, http.StatusNotFound, call{method: "POST", path: "/sandboxes/0123456789abcdef0123/pause", key: d.key})
	d.expect(t, http.StatusConflict, call{method: "POST", path: path + "/resume", key: d.key})
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: path + "/pause", key: d.key, body: []byte(`{"memory": "no"}`), invalid: true})
	d.kill(t, d.key, sb.SandboxID)
	d.expect(t, http.StatusNotFound, call{method: "POST", path: "/v2" + path + "/connect", key: d.key})
	for _, body := range []map[string]any{
		{"templateID": "host", "autoPauseMemory": false},
		{"templateID": "host", "autoPause": true, "autoPauseMemory": false, "autoResume": map[string]any{"enabled": true}},
	} {
		d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/v2/sandboxes", key: d.key, body: body})
	}
}

// TestLifecycle: a sandbox that pauses at its timeout and resumes on
// traffic: getInfo reports it; it is paused once its time is up; an
// anonymous /health does not wake it; a request with its access token
// does, and goes through.
func TestLifecycle(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 2, "autoPause": true, "autoResume": map[string]any{"enabled": true}})
	id := sb.SandboxID
	if got := d.get(t, d.key, id); got.Lifecycle.OnTimeout != "pause" || !got.Lifecycle.AutoResume {
		t.Errorf("lifecycle %+v, want pause and auto-resume", got.Lifecycle)
	}
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	mustRun(t, ac, "echo before > /home/user/f")
	if why := eventually(20*time.Second, func() string {
		if s := d.get(t, d.key, id).State; s != "paused" {
			return "state " + string(s)
		}
		return ""
	}); why != "" {
		t.Fatalf("not paused after its timeout: %s", why)
	}
	r := d.proxyGet(t, "/health", map[string]string{"E2b-Sandbox-Id": id}, "")
	checkProxyError(t, r, id, "The sandbox was not found")
	if s := d.get(t, d.key, id).State; s != "paused" {
		t.Errorf("an anonymous /health woke the sandbox: state %s", s)
	}
	if out := mustRun(t, ac, "cat /home/user/f"); out != "before\n" {
		t.Errorf("through the proxy with the token, after auto-resume: %q", out)
	}
	if s := d.get(t, d.key, id).State; s != "running" {
		t.Errorf("after traffic with its token: state %s, want running", s)
	}
}

// TestSnapshotAndFork: a snapshot saves a running sandbox's files while it
// runs on (same id, same end time, its processes going on); sandboxes
// created from it start with those files, each with an identity of its
// own; it is listed, deleted (by its percent-encoded id) and then gone.
func TestSnapshotAndFork(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, map[string]any{"timeout": 600, "envVars": map[string]string{"FROM": "origin"}})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	mustRun(t, ac, "mkdir -p /home/user/work && echo v1 > /home/user/work/state && "+counter)
	before := d.get(t, d.key, id)

	var info types.SnapshotInfo
	d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/snapshots", key: d.key, body: map[string]any{"name": "proj"}}).decode(t, &info)
	if info.SnapshotID != "cage/proj:default" || len(info.Names) != 1 || info.Names[0] != "cage/proj" || info.Kind != "files" {
		t.Errorf("snapshot: %+v", info)
	}
	after := d.get(t, d.key, id)
	if after.State != "running" || !after.EndAt.Equal(before.EndAt) {
		t.Errorf("the snapshotted sandbox: state %s, end %v (was %v)", after.State, after.EndAt, before.EndAt)
	}
	c1 := count(t, mustRun(t, ac, "cat /tmp/count"))
	time.Sleep(500 * time.Millisecond)
	if c2 := count(t, mustRun(t, ac, "cat /tmp/count")); c2 <= c1 {
		t.Errorf("the snapshotted sandbox's processes stopped: %d then %d", c1, c2)
	}
	d.expect(t, http.StatusConflict, call{method: "POST", path: path + "/snapshots", key: d.key, body: map[string]any{"name": "proj"}})
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: path + "/snapshots", key: d.key, body: map[string]any{"name": "no/slash"}, invalid: true})

	var listed []types.SnapshotInfo
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots?sandboxID=" + id, key: d.key}).decode(t, &listed)
	if len(listed) != 1 || listed[0].SnapshotID != info.SnapshotID {
		t.Errorf("list: %+v", listed)
	}
	d.expect(t, http.StatusOK, call{method: "GET", path: "/snapshots", key: d.createKey(t, "stranger")}).decode(t, &listed)
	if len(listed) != 0 {
		t.Errorf("another key lists %d snapshots", len(listed))
	}

	seen := map[string]bool{id: true}
	for i := 0; i < 3; i++ {
		child := d.create(t, d.key, map[string]any{"templateID": info.SnapshotID, "timeout": 120})
		if seen[child.SandboxID] || child.EnvdAccessToken == sb.EnvdAccessToken {
			t.Errorf("fork %d: id %s, same token %v", i, child.SandboxID, child.EnvdAccessToken == sb.EnvdAccessToken)
		}
		seen[child.SandboxID] = true
		cac := d.agent(child.SandboxID, child.EnvdAccessToken)
		out := mustRun(t, cac, "cat /home/user/work/state; echo $FROM; hostname; pgrep -f '[c]ount.new' || echo none")
		cac.Close()
		want := "v1\norigin\ncage-" + child.SandboxID[:8] + "\nnone\n"
		if out != want {
			t.Errorf("fork %d: %q, want %q", i, out, want)
		}
	}
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/templates/" + url.PathEscape(info.SnapshotID), key: d.key})
	d.expect(t, http.StatusNotFound, call{method: "DELETE", path: "/templates/" + url.PathEscape(info.SnapshotID), key: d.key})
	d.expect(t, http.StatusNotFound, call{method: "POST", path: "/v2/sandboxes", key: d.key, body: map[string]any{"templateID": info.SnapshotID}})

	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
	d.expect(t, http.StatusConflict, call{method: "POST", path: path + "/snapshots", key: d.key, body: map[string]any{}})
}

// TestPausedSurvivesCrash: a sandbox paused with its memory survives kill
// -9 of the daemon (the next one adopts it frozen, and its counter goes on
// after resume); one that also lost its processes (a host restart: every
// sandbox process killed, /run cleared) resumes from its files. Nothing is
// left on the host or in the data directory once they are killed.
func TestPausedSurvivesCrash(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	frozen := d.create(t, d.key, map[string]any{"timeout": 600})
	lost := d.create(t, d.key, map[string]any{"timeout": 600})
	for _, sb := range []types.Sandbox{frozen, lost} {
		ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
		mustRun(t, ac, "echo mine > /home/user/mine; "+counter)
		ac.Close()
	}
	time.Sleep(300 * time.Millisecond)
	for _, sb := range []types.Sandbox{frozen, lost} {
		d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/pause", key: d.key})
	}
	v0 := count(t, readFrozenCount(t, d, frozen.SandboxID))

	d.kill9(t)
	d.start(t)
	if got := d.get(t, d.key, frozen.SandboxID); got.State != "paused" || got.PausedWith != "memory" {
		t.Errorf("the frozen sandbox after kill -9 of the daemon: %s %s", got.State, got.PausedWith)
	}
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + frozen.SandboxID + "/connect", key: d.key})
	ac := d.agent(frozen.SandboxID, frozen.EnvdAccessToken)
	if v := count(t, mustRun(t, ac, "cat /tmp/count")); v < v0 || v > v0+5 {
		t.Errorf("the frozen sandbox's counter after the daemon's crash and a resume: %d (it stood at %d)", v, v0)
	}
	ac.Close()

	// The host restarts: the other paused sandbox loses its processes.
	d.kill9(t)
	agent := agentOf(t, lost.SandboxID)
	for _, dir := range cgroupDirs(lost.SandboxID) { // a frozen task dies only once thawed
		_ = os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0)
		_ = os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("0"), 0)
	}
	_ = syscall.Kill(agent, syscall.SIGKILL)
	for i := 0; i < 100; i++ {
		if _, ok := readProc(agent); !ok {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	d.start(t)
	if got := d.get(t, d.key, lost.SandboxID); got.State != "paused" || got.PausedWith != "files" {
		t.Errorf("a paused sandbox whose processes died with the host: %s %s, want paused files", got.State, got.PausedWith)
	}
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + lost.SandboxID + "/connect", key: d.key})
	ac = d.agent(lost.SandboxID, lost.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /home/user/mine; pgrep -f '[c]ount.new' || echo none"); out != "mine\nnone\n" {
		t.Errorf("resumed from its files after the host lost it: %q", out)
	}
	ac.Close()
	for _, sb := range []types.Sandbox{frozen, lost} {
		d.kill(t, d.key, sb.SandboxID)
		d.checkGone(t, sb.SandboxID, 5*time.Second)
	}
	for _, dir := range []string{"paused", "snapshots"} {
		if left, _ := filepath.Glob(filepath.Join(d.data, dir, "*")); len(left) > 0 {
			t.Errorf("left in DATA/%s: %v", dir, left)
		}
	}
}
