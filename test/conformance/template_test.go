package conformance

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// testTemplate is the name the test image is imported as, once per run.
const testTemplate = "cage-test"

var importOnce sync.Once

// importTestImage puts the test image (testutil.TestImage) in the store of
// the suite's host.
func importTestImage(t testing.TB) *imgstore.Template {
	h := processHost(t)
	img := testutil.TestImage(t)
	var err error
	importOnce.Do(func() {
		path := testutil.WriteDockerArchive(t, img, "cage-test:latest")
		_, err = h.Templates.Import(context.Background(), path, testTemplate, imgstore.Options{})
	})
	if err != nil {
		t.Fatalf("import the test image: %v", err)
	}
	tm, err := h.Templates.Get(testTemplate)
	if err != nil {
		t.Fatal(err)
	}
	return tm
}

// TestImageTemplate: a sandbox of an image template sees the image's files
// with their owners (through the idmapping), the layers merged (whiteouts
// applied), a writable root whose writes stay its own, the disk limit, and
// setuid bits without effect.
func TestImageTemplate(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		importTestImage(t)
		b := w.newBox(t, sandbox.Options{Template: testTemplate, Disk: 16 << 20})
		checks := []struct {
			name, script, user, want string
		}{
			{"image's file", "cat /etc/os-release | head -1", "", "ID=cage-test"},
			{"second layer", "cat /usr/local/share/layer2", "", "second layer"},
			{"whiteout", "test -e /etc/doomed && echo present || echo gone", "", "gone"},
			{"root's files are root's", "stat -c '%u %g' /bin/busybox", "", "0 0"},
			{"user's files are user's", "stat -c '%u %g' /opt/data/owned1000", "", "1000 1000"},
			{"default user", "id -u; whoami", "", "1000\nuser"},
			{"home", "cd && pwd && touch x && ls", "", "/home/user\nx"},
			{"image env", "echo $CAGE_TEST_IMAGE", "", "1"},
			{"identity files", "cat /etc/hostname", "", "cage-"},
			{"user cannot write the image", "touch /usr/local/share/mine 2>&1; echo rc=$?", "", "rc=1"},
			{"root writes the image", "echo mine > /usr/local/share/mine && cat /usr/local/share/mine", "root", "mine"},
			{"setuid kept as a bit", "stat -c %a /usr/local/bin/suid/id", "", "4755"},
			// busybox drops a setuid gain itself, so running the copy proves
			// nothing; what makes setuid bits inert is no_new_privs.
			{"setuid gives nothing", "grep NoNewPrivs /proc/self/status", "", "NoNewPrivs:\t1"},
			{"disk limit", "dd if=/dev/zero of=/home/user/big bs=1M count=64 2>&1; echo rc=$?", "", "No space left"},
		}
		for _, c := range checks {
			var r result
			if c.user != "" {
				r = b.sh(c.script, asUser(c.user))
			} else {
				r = b.sh(c.script)
			}
			if r.err != nil || !strings.Contains(r.stdout, c.want) {
				t.Errorf("%s: %q: got stdout %q stderr %q err %v; want %q", c.name, c.script, r.stdout, r.stderr, r.err, c.want)
			}
		}
		// A second sandbox of the template does not see the first's writes.
		b2 := w.newBox(t, sandbox.Options{Template: testTemplate})
		if out := b2.sh("cat /usr/local/share/mine 2>&1; ls /home/user"); strings.Contains(out.stdout, "mine\n") || strings.Contains(out.stdout, "big") {
			t.Errorf("a second sandbox of the template sees the first's writes: %q", out.stdout)
		}
	})
}

// TestTemplateInUse: a template cannot be removed while a sandbox runs from
// it; once the sandbox is gone, it can, and its layers go with it.
func TestTemplateInUse(t *testing.T) {
	h := processHost(t)
	importTestImage(t)
	// A template of its own (the same image under another name shares its
	// layers), so that removing it leaves the suite's template alone.
	path := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:inuse")
	tm, err := h.Templates.Import(context.Background(), path, "inuse", imgstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Template: "inuse"})
	if err != nil {
		t.Fatal(err)
	}
	users := imgstore.InUse(tm)
	if len(users) != 1 {
		t.Errorf("InUse with one sandbox: %v", users)
	}
	err = h.Templates.Remove("inuse")
	if !errors.Is(err, imgstore.ErrInUse) || !strings.Contains(err.Error(), "inuse") {
		t.Errorf("Remove of a template in use: %v; want ErrInUse naming it", err)
	}
	if err := sb.Destroy(); err != nil {
		t.Fatal(err)
	}
	if users := imgstore.InUse(tm); len(users) != 0 {
		t.Errorf("after destroy, the template is still in use by %v", users)
	}
	if err := h.Templates.Remove("inuse"); err != nil {
		t.Fatalf("Remove after the sandbox is gone: %v", err)
	}
	// The suite's template shares every layer: none may be gone.
	shared, err := h.Templates.Get(testTemplate)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Templates.LayerDirs(shared); err != nil {
		t.Errorf("removing a template took a layer another uses: %v", err)
	}
	if _, err := os.Stat(filepath.Join(h.RunDir, "sandboxes", sb.ID())); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the sandbox's state directory is left: %v", err)
	}
}

// TestTemplatePool: a pool of prepared sandboxes of an image template
// serves its creates; once the template is imported again with other
// files, a sandbox prepared from the old image is not handed out (a fresh
// one is made), so no create runs in files that are no longer the
// template's.
func TestTemplatePool(t *testing.T) {
	shared := processHost(t)
	importTestImage(t)
	dir, err := os.MkdirTemp("/run", "cage-pool-")
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(dir, 0o711)
	defer testutil.RemoveRunDir(dir)
	h, err := sandbox.NewHost(dir, shared.AgentPath, shared.Log)
	if err != nil {
		t.Fatal(err)
	}
	h.Templates = shared.Templates
	// A template of its own, so that importing it again leaves the suite's.
	if _, err := h.Templates.Import(context.Background(), testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:pool"), "pooled", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	// After the pool is gone (cleanups run after the deferred Close).
	t.Cleanup(func() {
		if err := h.Templates.Remove("pooled"); err != nil {
			t.Errorf("remove the pool's template: %v", err)
		}
	})
	h.PoolTemplate = "pooled"
	h.StartPool(1)
	defer h.Close()
	osRelease := func() string {
		// Networked, as the pool's sandboxes are made until creates ask
		// otherwise (E2B's SDKs ask for a network by default); allowing
		// nothing.
		sb, err := h.Create(context.Background(), sandbox.Options{Template: "pooled", Net: network.Policy{Mode: network.Allowlist}})
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Destroy()
		c := agentclient.New(sb.Dial, sb.Token())
		defer c.Close()
		var out strings.Builder
		if _, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "head", Args: []string{"-1", "/etc/os-release"}, Stdout: &out}); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	waitPool := func() {
		// The pool fills in the background; a create that finds it empty
		// is counted as a miss.
		time.Sleep(1500 * time.Millisecond)
	}
	waitPool()
	misses := h.PoolMisses()
	if got := osRelease(); got != "ID=cage-test\n" {
		t.Errorf("pooled create: %q", got)
	}
	if h.PoolMisses() != misses {
		t.Errorf("the create of the pool's template found the pool empty")
	}
	// Import other files under the name: what the pool prepared is stale.
	waitPool()
	layer := testutil.Layer(t, testutil.LayerTar(t, []testutil.TarEntry{{Name: "etc/os-release", Body: []byte("ID=changed\n")}}))
	img, err := mutate.AppendLayers(testutil.TestImage(t), layer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Templates.Import(context.Background(), testutil.WriteDockerArchive(t, img, "cage-test:changed"), "pooled", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	if got := osRelease(); got != "ID=changed\n" {
		t.Errorf("after the template changed, a create ran in %q; want the new files", got)
	}
}

// TestPoolGrowsWithDemand: a pool sized 1 that may grow to 4 (PoolGrow)
// keeps one more for each create that found it empty, so that the next
// burst of as many creates is served from it entirely; once no create has
// come for its idle time it destroys what it keeps beyond its size (the
// sandboxes' state directories go with them), back to 1.
func TestPoolGrowsWithDemand(t *testing.T) {
	h, dir := poolHost(t, "cage-poolgrow-", func(h *sandbox.Host) { h.PoolGrow, h.PoolIdle = 4, time.Second })
	stat := func() sandbox.PoolStat {
		s := h.PoolStats()
		if len(s) != 1 {
			t.Fatalf("pools: %+v", s)
		}
		return s[0]
	}
	waitFor := func(what string, ok func(sandbox.PoolStat) bool) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for !ok(stat()) {
			if time.Now().After(deadline) {
				t.Fatalf("the pool never %s: %+v", what, stat())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	full := func(s sandbox.PoolStat) bool { return s.Ready == s.Size }
	burst := func(n int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sb, err := h.Create(context.Background(), sandbox.Options{})
				if err != nil {
					errs <- err
					return
				}
				c := agentclient.New(sb.Dial, sb.Token())
				defer c.Close()
				if _, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "true"}); err != nil {
					errs <- err
				}
				if err := sb.Destroy(); err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	waitFor("filled", full)
	if s := stat(); s.Size != 1 || s.Floor != 1 || s.Max != 4 {
		t.Fatalf("a pool of 1 growing 4 times: %+v", s)
	}
	// A burst of 3: at most one from the pool (none where its member has
	// a network interface and these creates ask for none), the others find
	// it empty, and it keeps one more for each.
	before := stat()
	burst(3)
	s := stat()
	missed := s.Misses - before.Misses
	if missed < 2 || s.Size != min(1+int(missed), 4) {
		t.Fatalf("after a burst of 3 (%d found the pool empty) the pool keeps %d, want %d: %+v", missed, s.Size, min(1+missed, 4), s)
	}
	waitFor("refilled to its grown size", full)
	// The same burst again: every create from the pool.
	before = stat()
	burst(s.Size)
	if after := stat(); after.Misses != before.Misses || after.Hits-before.Hits != int64(s.Size) {
		t.Errorf("a second burst of %d: %d from the pool, %d found it empty (%+v)", s.Size, after.Hits-before.Hits, after.Misses-before.Misses, after)
	}
	waitFor("refilled again", full)
	if n := len(stateDirs(t, dir)); n != stat().Size {
		t.Errorf("%d sandbox state directories with %d in the pool", n, stat().Size)
	}
	// No creates: back to its size, the sandboxes beyond it destroyed.
	waitFor("shrank back to 1", func(s sandbox.PoolStat) bool { return s.Size == 1 && s.Ready == 1 })
	deadline := time.Now().Add(10 * time.Second)
	for len(stateDirs(t, dir)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("after the pool shrank to 1: sandbox state directories %v", stateDirs(t, dir))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// poolHost is a process-wall host of its own in a run directory under
// /run named from prefix, set by set (when not nil) and keeping a pool of
// one sandbox of the host template; it is closed, and its directory
// removed, at the test's end.
func poolHost(t *testing.T, prefix string, set func(*sandbox.Host)) (*sandbox.Host, string) {
	t.Helper()
	shared := processHost(t)
	dir, err := os.MkdirTemp("/run", prefix)
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(dir, 0o711)
	t.Cleanup(func() { testutil.RemoveRunDir(dir) })
	h, err := sandbox.NewHost(dir, shared.AgentPath, shared.Log)
	if err != nil {
		t.Fatal(err)
	}
	h.Templates = shared.Templates
	if set != nil {
		set(h)
	}
	h.StartPool(1)
	t.Cleanup(h.Close) // before the directory goes
	return h, dir
}

func stateDirs(t *testing.T, runDir string) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(runDir, "sandboxes"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// TestPoolSizesFit: a pooled process-wall sandbox of the host template is
// sealed before its create, so it serves only creates of the disk and
// /dev/shm sizes it was built with; a create of other sizes is made cold
// and gets what it asked, and one of the pool's sizes is served from it.
func TestPoolSizesFit(t *testing.T) {
	h, dir := poolHost(t, "cage-poolsizes-", nil)
	waitFull := func() {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for s := h.PoolStats(); len(s) != 1 || s[0].Ready != 1; s = h.PoolStats() {
			if time.Now().After(deadline) {
				t.Fatalf("the pool never filled: %+v", s)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	sizes := func(o sandbox.Options, wantPooled bool) string {
		t.Helper()
		waitFull()
		misses := h.PoolMisses()
		sb, err := h.Create(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Destroy()
		if pooled := h.PoolMisses() == misses; pooled != wantPooled {
			t.Errorf("create %+v: from the pool %v, want %v", o, pooled, wantPooled)
		}
		// The default limits, whether the pool applied them or the create.
		if data, err := os.ReadFile(filepath.Join(sb.Cgroup().Dir("pids"), "pids.max")); err != nil || strings.TrimSpace(string(data)) != fmt.Sprint(sandbox.DefaultPids+insideAgentThreads()) {
			t.Errorf("create %+v: pids.max %q (%v), want %d", o, data, err, sandbox.DefaultPids+insideAgentThreads())
		}
		c := agentclient.New(sb.Dial, sb.Token())
		defer c.Close()
		var out strings.Builder
		if _, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "sh", Args: []string{"-c", "df -k /tmp /dev/shm | tail -2 | awk '{print $2}'"}, Stdout: &out}); err != nil {
			t.Fatal(err)
		}
		return strings.Join(strings.Fields(out.String()), " ")
	}
	// The member waiting in the pool seals itself without a create: its
	// agent, the only process in its cgroup, gets no_new_privs and its
	// seccomp filter (it builds its root first, after the pool has it).
	waitFull()
	ids := stateDirs(t, dir)
	if len(ids) != 1 {
		t.Fatalf("state directories with one sandbox in the pool: %v", ids)
	}
	unsealed := func() (found int, not []string) {
		procs, _ := os.ReadDir("/proc")
		for _, p := range procs {
			cg, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cgroup"))
			if err != nil || !strings.Contains(string(cg), ids[0]) {
				continue
			}
			status, err := os.ReadFile(filepath.Join("/proc", p.Name(), "status"))
			if err != nil {
				continue
			}
			found++
			if !strings.Contains(string(status), "NoNewPrivs:\t1") || !strings.Contains(string(status), "Seccomp:\t2") {
				not = append(not, p.Name())
			}
		}
		return found, not
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		found, not := unsealed()
		if found > 0 && len(not) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pooled sandbox %s, before any create: %d processes, not sealed: %v", ids[0], found, not)
		}
	}
	if s := h.PoolStats(); s[0].Hits+s[0].Misses != 0 {
		t.Fatalf("a create came before the check: %+v", s)
	}
	// The pool makes networked members until creates ask otherwise: ask
	// for none, then wait for the pool to turn.
	sizes(sandbox.Options{}, false)
	if got, want := sizes(sandbox.Options{}, true), fmt.Sprintf("%d %d", sandbox.DefaultDisk>>10, sandbox.DefaultShm>>10); got != want {
		t.Errorf("pooled create: disk and /dev/shm %s KiB, want %s", got, want)
	}
	if got := sizes(sandbox.Options{Disk: 96 << 20}, false); got != fmt.Sprintf("%d %d", 96<<10, sandbox.DefaultShm>>10) {
		t.Errorf("a create of a 96 MiB disk: disk and /dev/shm %s KiB", got)
	}
	if got := sizes(sandbox.Options{Shm: 16 << 20}, false); got != fmt.Sprintf("%d %d", sandbox.DefaultDisk>>10, 16<<10) {
		t.Errorf("a create of a 16 MiB /dev/shm: disk and /dev/shm %s KiB", got)
	}
}
