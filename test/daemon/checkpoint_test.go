package daemontest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// checkpointWalls are the walls whose pause with memory is a checkpoint,
// with the template each runs here; a wall missing here is skipped (or
// fails where CAGE_REQUIRE_WALLS names it).
func checkpointWalls(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, w := range []string{"gvisor", "microvm"} {
		tmpl := "host"
		if w == "microvm" {
			tmpl = "base"
		}
		switch {
		case !wallHere(w):
			if testutil.WallRequired(w) {
				t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but is not on this host", w)
			}
			t.Logf("SKIP wall %s: not on this host", w)
		case w == "microvm" && os.Getenv("CAGE_TEMPLATES") == "":
			if testutil.WallRequired(w) {
				t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but CAGE_TEMPLATES names no template store", w)
			}
			t.Logf("SKIP wall %s: no template store (CAGE_TEMPLATES)", w)
		default:
			out[w] = tmpl
		}
	}
	return out
}

// templatesConfig is a config file with the test world's resolver and the
// template store CAGE_TEMPLATES names.
func templatesConfig(t *testing.T) string {
	t.Helper()
	cfg := map[string]any{"network": map[string]any{"dns": testutil.SharedWorld(t).Upstreams()}}
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		cfg["templates"] = dir
	}
	p := filepath.Join(t.TempDir(), "config.json")
	b, _ := json.Marshal(cfg)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// hostProcs counts the processes the host runs for sandbox id (its
// cgroups'): none while it is checkpointed.
func hostProcs(id string) int {
	n := 0
	for _, dir := range cgroupDirs(id) {
		n += len(readPids(filepath.Join(dir, "cgroup.procs")))
	}
	return n
}

// hostRestart is what a restart of the host leaves: every sandbox process
// killed, the run directory empty.
func (d *daemon) hostRestart(t *testing.T) {
	t.Helper()
	d.kill9(t)
	forceRemoveSandboxes(d.runDir)
	testutil.RemoveRunDir(d.runDir)
	if err := os.Mkdir(d.runDir, 0o711); err != nil {
		t.Fatal(err)
	}
}

// TestPauseCheckpoint: on gVisor and microvm a pause with memory is a
// checkpoint: pausedWith says so, the host runs nothing for the sandbox
// (its cgroup is empty or gone, QEMU has ended) while its checkpoint is in
// the data directory, and each resume goes on where it stood: the counting
// process counts on from its count at the pause, not from where 3 s of
// running would have taken it. A checkpointed sandbox survives kill -9 of
// the daemon and resumes from its checkpoint. A damaged checkpoint is
// given up at resume: the sandbox starts again from its files (201, its
// processes gone, its files there). Kill leaves nothing.
func TestPauseCheckpoint(t *testing.T) {
	t.Parallel()
	walls := checkpointWalls(t)
	for _, w := range []string{"gvisor", "microvm"} {
		tmpl, ok := walls[w]
		if !ok {
			continue
		}
		t.Run(w, func(t *testing.T) {
			d := startDaemon(t, "--config", templatesConfig(t))
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 600})
			id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
			ac := d.agent(id, sb.EnvdAccessToken)
			defer ac.Close()
			mustRun(t, ac, "echo kept > /home/user/file; "+counter+" sleep 1")
			ckpt := filepath.Join(d.data, "checkpoints", id)
			cycle := func(what string) {
				t.Helper()
				v0 := count(t, mustRun(t, ac, "cat /tmp/count"))
				d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{}})
				if got := d.get(t, d.key, id); got.State != "paused" || got.PausedWith != "checkpoint" {
					t.Errorf("%s: after pause: state %q, pausedWith %q; want paused, checkpoint", what, got.State, got.PausedWith)
				}
				if n := hostProcs(id); n != 0 {
					t.Errorf("%s: the host runs %d processes for a checkpointed sandbox", what, n)
				}
				if fi, err := os.Stat(ckpt); err != nil || !fi.IsDir() {
					t.Errorf("%s: no checkpoint at %s: %v", what, ckpt, err)
				}
				time.Sleep(3 * time.Second)
				d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 600}})
				v1 := count(t, mustRun(t, ac, "cat /tmp/count"))
				if v1 < v0 || v1 > v0+20 {
					t.Errorf("%s: the counter read %d at the pause and %d after the resume (3 s paused would be +30 had it run)", what, v0, v1)
				}
				time.Sleep(500 * time.Millisecond)
				if v2 := count(t, mustRun(t, ac, "cat /tmp/count")); v2 <= v1 {
					t.Errorf("%s: the counter does not go on after the resume: %d then %d", what, v1, v2)
				}
				if got := d.get(t, d.key, id); got.State != "running" || got.PausedWith != "" {
					t.Errorf("%s: after resume: state %q pausedWith %q", what, got.State, got.PausedWith)
				}
				if _, err := os.Stat(ckpt); err == nil {
					t.Errorf("%s: a resumed sandbox's checkpoint was left", what)
				}
				// Its network, with the same address, as before.
				if got := strings.TrimSpace(run(ac, fmt.Sprintf("python3 -c '%s' %s", pyFetch, "http://other.example.org/")).stdout); got != "OK:other "+testutil.OtherHost.String() {
					t.Errorf("%s: after the resume, GET other.example.org: %q", what, got)
				}
			}
			cycle("first cycle")
			cycle("second cycle")

			// kill -9 of the daemon while checkpointed.
			v0 := count(t, mustRun(t, ac, "cat /tmp/count"))
			d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
			d.kill9(t)
			d.start(t)
			if got := d.get(t, d.key, id); got.State != "paused" || got.PausedWith != "checkpoint" {
				t.Errorf("after kill -9 of the daemon: state %q pausedWith %q, want paused checkpoint", got.State, got.PausedWith)
			}
			d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key})
			if v := count(t, mustRun(t, ac, "cat /tmp/count")); v < v0 || v > v0+20 {
				t.Errorf("the counter after the daemon's crash and a resume: %d (it stood at %d)", v, v0)
			}
			if got := strings.TrimSpace(run(ac, fmt.Sprintf("python3 -c '%s' %s", pyFetch, "http://other.example.org/")).stdout); got != "OK:other "+testutil.OtherHost.String() {
				t.Errorf("after the daemon's crash and a resume, GET other.example.org: %q", got)
			}

			// A damaged checkpoint: resumed from its files.
			d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
			files, _ := filepath.Glob(filepath.Join(ckpt, "*"))
			for _, f := range files {
				if err := os.Truncate(f, 100); err != nil {
					t.Fatal(err)
				}
			}
			d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key})
			if out := mustRun(t, ac, "cat /home/user/file; pgrep -f '[c]ount.new' || echo no-counter"); out != "kept\nno-counter\n" {
				t.Errorf("resumed after its checkpoint was damaged: %q, want its files without its processes", out)
			}
			if !strings.Contains(d.log.String(), "checkpoint unusable") {
				t.Errorf("the daemon's log does not say the checkpoint was unusable")
			}
			d.kill(t, d.key, id)
			d.checkGone(t, id, 10*time.Second)
			for _, dir := range []string{"paused", "checkpoints"} {
				if left, _ := filepath.Glob(filepath.Join(d.data, dir, "*")); len(left) > 0 {
					t.Errorf("left in DATA/%s: %v", dir, left)
				}
			}
		})
	}
}

// TestCheckpointHostRestart: a checkpointed sandbox whose host restarted
// (every sandbox process killed, the run directory cleared) is still
// paused. On microvm the checkpoint needs nothing the host lost: the
// sandbox resumes from it, its counter going on. On gVisor it needs the
// sandbox's state directory (bundle, disk, mounts), which is gone: it
// resumes from its files. Killed, nothing is left.
func TestCheckpointHostRestart(t *testing.T) {
	t.Parallel()
	walls := checkpointWalls(t)
	if len(walls) == 0 {
		return
	}
	d := startDaemon(t, "--config", templatesConfig(t))
	type box struct{ wall, id, token string }
	var boxes []box
	for _, w := range []string{"gvisor", "microvm"} {
		if tmpl, ok := walls[w]; ok {
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 600})
			ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
			mustRun(t, ac, "echo mine > /home/user/mine; "+counter+" sleep 1")
			ac.Close()
			d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/pause", key: d.key})
			boxes = append(boxes, box{w, sb.SandboxID, sb.EnvdAccessToken})
		}
	}
	d.hostRestart(t)
	d.start(t)
	for _, b := range boxes {
		want := map[string]string{"gvisor": "files", "microvm": "checkpoint"}[b.wall]
		if got := d.get(t, d.key, b.id); got.State != "paused" || string(got.PausedWith) != want {
			t.Errorf("%s after a host restart: %s %s, want paused %s", b.wall, got.State, got.PausedWith, want)
		}
		d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + b.id + "/connect", key: d.key})
		ac := d.agent(b.id, b.token)
		wantOut := map[string]string{"gvisor": "mine\nno-counter\n", "microvm": "mine\ncounting\n"}[b.wall]
		if out := mustRun(t, ac, "cat /home/user/mine; pgrep -f '[c]ount.new' >/dev/null && echo counting || echo no-counter"); out != wantOut {
			t.Errorf("%s resumed after a host restart: %q, want %q", b.wall, out, wantOut)
		}
		ac.Close()
		d.kill(t, d.key, b.id)
		d.checkGone(t, b.id, 10*time.Second)
	}
	for _, dir := range []string{"paused", "checkpoints"} {
		if left, _ := filepath.Glob(filepath.Join(d.data, dir, "*")); len(left) > 0 {
			t.Errorf("left in DATA/%s: %v", dir, left)
		}
	}
}

// postCut posts {} to path, as a request the daemon's crash cuts short
// (its answer, if any, is not looked at).
func (d *daemon) postCut(path, key string) {
	req, _ := http.NewRequest(http.MethodPost, d.apiURL()+path, strings.NewReader("{}"))
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	if resp, err := d.http.Do(req); err == nil {
		resp.Body.Close()
	}
}

// TestCheckpointCrashes: kill -9 of the daemon as it checkpoints (the
// moment its checkpoint directory appears) and as it restores (a moment
// into the resume): the next daemon has the sandbox paused or running,
// never lost; a resume then works and its files are whole; killed, it
// leaves nothing. And a checkpoint the data directory has no room for is
// refused with a clear error while the sandbox runs on.
func TestCheckpointCrashes(t *testing.T) {
	t.Parallel()
	walls := checkpointWalls(t)
	for _, w := range []string{"gvisor", "microvm"} {
		tmpl, ok := walls[w]
		if !ok {
			continue
		}
		t.Run(w, func(t *testing.T) {
			d := startDaemon(t, "--config", templatesConfig(t))
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 600})
			id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
			ac := d.agent(id, sb.EnvdAccessToken)
			defer ac.Close()
			mustRun(t, ac, "head -c 1000000 /dev/urandom > /home/user/blob; sha256sum /home/user/blob > /home/user/sum; "+counter)
			check := func(what string) {
				t.Helper()
				got := d.get(t, d.key, id)
				if got.State != "paused" && got.State != "running" {
					t.Fatalf("%s: state %q", what, got.State)
				}
				want := http.StatusCreated
				if got.State == "running" {
					want = http.StatusOK
				}
				d.expect(t, want, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 600}})
				if out := mustRun(t, ac, "sha256sum -c /home/user/sum >/dev/null && echo whole"); out != "whole\n" {
					t.Errorf("%s: the files after the resume: %q", what, out)
				}
				t.Logf("%s: the next daemon found it %s (%s)", what, got.State, got.PausedWith)
			}

			// While checkpointing.
			part := filepath.Join(d.data, "checkpoints", id+".part")
			done := make(chan struct{}, 1)
			go func() { d.postCut(path+"/pause", d.key); done <- struct{}{} }()
			if eventually(60*time.Second, func() string {
				if _, err := os.Stat(part); err != nil {
					return "no checkpoint under way"
				}
				return ""
			}) != "" {
				t.Fatalf("no checkpoint appeared at %s", part)
			}
			d.kill9(t)
			<-done
			d.start(t)
			check("kill -9 while checkpointing")

			// While restoring.
			d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key})
			go func() { d.postCut("/v2"+path+"/connect", d.key); done <- struct{}{} }()
			time.Sleep(150 * time.Millisecond)
			d.kill9(t)
			<-done
			d.start(t)
			check("kill -9 while restoring")

			// No room for the checkpoint: refused, the sandbox runs on.
			mustRun(t, ac, counter+" sleep 1") // a resume from files ended the first
			dir := filepath.Join(d.data, "checkpoints")
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16m"); err != nil {
				t.Fatal(err)
			}
			defer unix.Unmount(dir, unix.MNT_DETACH)
			r := d.do(t, call{method: "POST", path: path + "/pause", key: d.key})
			if r.status < 500 || !strings.Contains(string(r.body), "disk space") {
				t.Errorf("a checkpoint with no room for it: %s, want a 5xx saying so", r)
			}
			if got := d.get(t, d.key, id); got.State != "running" {
				t.Errorf("after a checkpoint refused: state %q, want running", got.State)
			}
			v1 := count(t, mustRun(t, ac, "cat /tmp/count"))
			time.Sleep(500 * time.Millisecond)
			if v2 := count(t, mustRun(t, ac, "cat /tmp/count")); v2 <= v1 {
				t.Errorf("the counter stopped after a refused checkpoint: %d then %d", v1, v2)
			}
			if _, err := os.Stat(filepath.Join(d.data, "paused", id+".tar")); err == nil {
				t.Errorf("a refused checkpoint left the saved files")
			}
			d.kill(t, d.key, id)
			d.checkGone(t, id, 10*time.Second)
			left, _ := filepath.Glob(filepath.Join(d.data, "paused", "*"))
			more, _ := filepath.Glob(filepath.Join(dir, "*"))
			if len(left)+len(more) > 0 {
				t.Errorf("left in the data directory: %v %v", left, more)
			}
		})
	}
}

// Attack (on a tenant's own lock-down): a sandbox created with the
// internet, whose policy its owner then narrows to an allowlist (packages
// installed, untrusted code next), is paused with its memory (autoPause at
// its timeout does the same) and resumed (autoResume: any traffic with its
// token). The microvm's restore made its network again from the create's
// policy: the record said allowlist, the guest had the internet again.
// Expected: after the checkpoint's resume, on each wall that checkpoints,
// the sandbox's network is the policy it had at the pause.
func TestCheckpointKeepsNetworkPolicy(t *testing.T) {
	t.Parallel()
	walls := checkpointWalls(t)
	for _, w := range []string{"gvisor", "microvm"} {
		tmpl, ok := walls[w]
		if !ok {
			continue
		}
		t.Run(w, func(t *testing.T) {
			d := startDaemon(t, "--config", templatesConfig(t))
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "timeout": 600})
			id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
			ac := d.agent(id, sb.EnvdAccessToken)
			defer ac.Close()
			get := func(url string) string {
				t.Helper()
				return strings.TrimSpace(run(ac, fmt.Sprintf("python3 -c '%s' %s", pyFetch, url)).stdout)
			}
			if got := get("http://other.example.org/"); got != "OK:other "+testutil.OtherHost.String() {
				t.Fatalf("created with the internet: GET other.example.org: %q", got)
			}
			d.expect(t, http.StatusNoContent, call{method: "PUT", path: path + "/network", key: d.key,
				body: map[string]any{"allowOut": []string{"allowed.example.com"}, "denyOut": []string{"0.0.0.0/0"}}})
			if got := get("http://other.example.org/"); strings.HasPrefix(got, "OK:") {
				t.Fatalf("narrowed to an allowlist: other.example.org answered: %q", got)
			}
			for cycle := 1; cycle <= 2; cycle++ {
				d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{}})
				if got := d.get(t, d.key, id); got.PausedWith != "checkpoint" {
					t.Fatalf("cycle %d: paused with %q, want checkpoint", cycle, got.PausedWith)
				}
				d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 600}})
				if n := d.networkOf(t, id); n.Network.Mode != "allowlist" {
					t.Errorf("cycle %d: the record after the resume: %+v, want the allowlist", cycle, n)
				}
				if got := get("http://other.example.org/"); strings.HasPrefix(got, "OK:") {
					t.Errorf("cycle %d: after the resume, other.example.org (denied before the pause) answered: %q", cycle, got)
				}
				if got := get("http://allowed.example.com/"); !strings.HasPrefix(got, "OK:public") {
					t.Errorf("cycle %d: after the resume, GET allowed.example.com: %q", cycle, got)
				}
			}
		})
	}
}
