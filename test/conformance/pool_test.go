package conformance

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	cagewall "github.com/cagehq/cage/internal/wall"
)

// TestWallPools: a pool on each wall serves creates of its template. A pooled sandbox carries the create's identity and nothing of
// the pool's: its own id and hostname (never an earlier sandbox's), the
// create's token (a connection with none is refused), its environment,
// limits and network policy; the network interface, or none, follows what
// creates ask for. Once the template is imported again, and once the agent
// binary changes, the pool drains what it prepared (counted as stale),
// refills, and no create runs in the old files or the old agent.
func TestWallPools(t *testing.T) {
	for _, w := range walls() {
		t.Run(w.name, func(t *testing.T) { testWallPool(t, w) })
	}
}

func testWallPool(t *testing.T, w wall) {
	shared, world := netHost(t)
	if err := shared.WallMissing(w.name); err != nil {
		w.newBox(t, sandbox.Options{}) // skips (or fails where required) with the reason
	}
	importTestImage(t)
	dir, err := os.MkdirTemp("/run", "cage-wallpool-")
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(dir, 0o711)
	// Last of all: the sandboxes, destroyed at the test's cleanup, make
	// the runtime's state directory again as they go.
	t.Cleanup(func() { testutil.RemoveRunDir(dir) })
	// An agent of its own, changed below.
	agent := filepath.Join(dir, "cage-agent")
	if err := copyExec(shared.AgentPath, agent); err != nil {
		t.Fatal(err)
	}
	h, err := sandbox.NewHost(dir, agent, shared.Log)
	if err != nil {
		t.Fatal(err)
	}
	h.Templates, h.KernelDir = shared.Templates, shared.KernelDir
	h.NetConfig.Upstreams = world.Upstreams()
	name := "pool-" + w.name
	if _, err := h.Templates.Import(context.Background(), testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:"+name), name, imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Templates.Remove(name) })
	if err := h.AddWallPool(w.name, name, 1); err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	stat := func() sandbox.PoolStat {
		for _, s := range h.PoolStats() {
			if s.Wall == w.name && s.Template == name {
				return s
			}
		}
		t.Fatalf("no pool of %s on %s: %+v", name, w.name, h.PoolStats())
		return sandbox.PoolStat{}
	}
	// The pool fills in the background (a VM's first snapshot is made
	// then): wait for it, however long that takes here.
	waitFor := func(what string, ok func(sandbox.PoolStat) bool) {
		t.Helper()
		deadline := time.Now().Add(3 * time.Minute)
		for !ok(stat()) {
			if time.Now().After(deadline) {
				t.Fatalf("the pool never %s: %+v", what, stat())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	ready := func(s sandbox.PoolStat) bool { return s.Ready == 1 }
	seen := map[string]bool{}
	create := func(o sandbox.Options, wantHit bool) *box {
		t.Helper()
		before := stat().Hits
		o.Wall, o.Template = w.name, name
		sb, err := h.Create(context.Background(), o)
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		c := agentclient.New(sb.Dial, sb.Token())
		t.Cleanup(func() { c.Close(); _ = sb.Destroy() })
		if hit := stat().Hits > before; hit != wantHit {
			t.Errorf("create %+v: from the pool %v, want %v (%+v)", o, hit, wantHit, stat())
		}
		if seen[sb.ID()] {
			t.Errorf("sandbox id %s handed out twice", sb.ID())
		}
		seen[sb.ID()] = true
		return &box{Client: c, sb: sb, t: t}
	}

	// A networked create, with its own environment and limits. A wall
	// whose pool warms its sandboxes up (microvm under TCG) starts them
	// with the defaults and no environment, and serves only such creates.
	d, err := h.Driver(w.name)
	if err != nil {
		t.Fatal(err)
	}
	warm, isWarmer := d.(cagewall.Warmer)
	warms := isWarmer && warm.WarmsUp()
	waitFor("filled", ready)
	o := sandbox.Options{Net: network.Policy{Mode: network.Internet}, Env: map[string]string{"POOL_VAR": "mine"}, Pids: 40}
	if warms {
		b := create(o, false)
		if got := b.mustSh("echo $POOL_VAR"); got != "mine\n" {
			t.Errorf("a create with an environment got %q", got)
		}
		o.Env, o.Pids = nil, 0
		waitFor("still filled", ready)
	}
	b := create(o, true)
	id := b.sb.ID()
	// Made at background priority, it runs the create's commands at the
	// normal one (runsc puts some of its helpers one lower; on microvm
	// the group is QEMU's, every thread of which a pool's VM started at
	// background priority, a warmed one as it ran its warm-up). Looked at
	// while a command the create started runs: under gVisor its threads
	// are stub threads the sentry made after the take, each given the
	// priority systrap fixed at the sandbox's first stub.
	up := make(chan struct{})
	var upOnce sync.Once
	running := make(chan result, 1)
	go func() {
		running <- b.run(func(o *agentclient.RunOptions) {
			o.Cmd, o.Args = "/bin/sh", []string{"-c", "echo up; exec sleep 4"}
			o.Stdout = writerFunc(func(p []byte) (int, error) { upOnce.Do(func() { close(up) }); return len(p), nil })
		})
	}()
	select {
	case <-up:
	case r := <-running:
		t.Fatalf("a command in the pooled sandbox ended before it wrote: %+v %v %q", r.end, r.err, r.stderr)
	}
	if cg := b.sb.Cgroup(); cg != nil {
		pids := cg.Procs()
		// And the runtime's helpers outside it (gVisor's gofer), which
		// name the sandbox on their command line.
		procs, _ := os.ReadDir("/proc")
		for _, p := range procs {
			pid, err := strconv.Atoi(p.Name())
			if cmd, _ := os.ReadFile("/proc/" + p.Name() + "/cmdline"); err == nil && strings.Contains(string(cmd), id) {
				pids = append(pids, pid)
			}
		}
		for _, pid := range pids {
			if n := niceOf(t, pid); n > 1 {
				cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
				// A helper the runtime started while the sandbox was made
				// may still be on its way out (gVisor's, seen three times:
				// its command line read empty just after its nice was
				// read): only one that is still there a second later, niced,
				// would run anything at the pool's priority.
				if n = lastingNice(pid, time.Second); n > 1 {
					t.Errorf("pooled %s sandbox: process %d (%s) has nice %d threads", w.name, pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '}), n)
				}
			}
		}
	}
	if r := <-running; r.err != nil || r.code() != 0 {
		t.Errorf("a command in the pooled sandbox: %+v %v %q", r.end, r.err, r.stderr)
	}
	if c, ok := d.(cagewall.Checkpointer); ok && c.CheckpointsMissing() == nil {
		// A pooled sandbox keeps its wall's abilities: pause with memory.
		if _, ok := b.sb.(cagewall.Checkpointable); !ok {
			t.Errorf("a pooled %s sandbox (%T) cannot be checkpointed", w.name, b.sb)
		}
	}
	want := ids.Hostname(id) + "\nmine\nID=cage-test"
	if warms {
		want = ids.Hostname(id) + "\n\nID=cage-test"
	}
	if got := strings.TrimSpace(b.mustSh("hostname; echo $POOL_VAR; head -1 /etc/os-release")); got != want {
		t.Errorf("pooled sandbox %s: hostname, env, files %q, want %q", id, got, want)
	}
	if out := b.mustSh(fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 5 %s 80 | tail -1`, testutil.PublicHost)); !strings.HasPrefix(out, "public") {
		t.Errorf("internet policy: the public host answered %q", out)
	}
	noToken := agentclient.New(b.sb.Dial, "")
	if _, err := noToken.Run(context.Background(), agentclient.RunOptions{Cmd: "true"}); err == nil {
		t.Errorf("a pooled sandbox's agent served a client without its token")
	}
	noToken.Close()
	if cg := b.sb.Cgroup(); cg != nil && w.name != "microvm" && !warms {
		// The host's group holds the sandbox (QEMU's is QEMU's own).
		file := "pids.max"
		if data, err := os.ReadFile(filepath.Join(cg.Dir("pids"), file)); err != nil || strings.TrimSpace(string(data)) != fmt.Sprint(40+insideAgentThreads()) {
			t.Errorf("pids limit of the pooled sandbox: %q (%v), want %d", data, err, 40+insideAgentThreads())
		}
	}
	if w.name != "gvisor" && !warms { // under gVisor the pids limit takes the sentry down (see the hostile table)
		r := b.sh("while :; do sleep 30 & done", withTimeout(60*time.Second))
		if r.err != nil || r.end.GetReason() != "pids_limit" {
			t.Errorf("fork loop in a pooled sandbox: %+v %v, want reason pids_limit", r.end, r.err)
		}
	}

	// Creates without a network: the pool turns to those.
	waitFor("refilled", ready)
	if cg := b.sb.Cgroup(); cg != nil && w.name == "microvm" {
		// QEMU's group weighs the least among the sandboxes' while the
		// pool holds it (its refill yields to them: a nice does not,
		// across groups), and as much as any once a create took it.
		if got := cpuWeight(t, cg.Dir("cpu")); got != "1024" && got != "100" {
			t.Errorf("the group of a taken pooled VM has CPU weight %s, want the default", got)
		}
		// The refilled pool's VM, among this host's (other hosts' pools
		// are beside them too, with CAGE_TEST_POOLS): the groups named
		// after the sandboxes whose state is under the host's directory.
		low, ours := 0, 0
		parent := filepath.Dir(cg.Dir("cpu"))
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() || filepath.Base(filepath.Dir(p)) != "sandboxes" {
				return nil
			}
			if g := filepath.Join(parent, d.Name()); len(readPids(g)) > 0 {
				ours++
				if w := cpuWeight(t, g); w == "2" || w == "1" {
					low++
				}
			}
			return fs.SkipDir
		})
		if ours < 2 || low != 1 {
			t.Errorf("of %d VMs of this host's (want the ones taken and the one refilled), %d had the least CPU weight; want 1", ours, low)
		}
	}
	create(sandbox.Options{}, false) // (the pool's sandbox had an interface)
	waitFor("refilled without a network", ready)
	b = create(sandbox.Options{}, true)
	if out := b.sh(fmt.Sprintf(`printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 %s 80`, testutil.PublicHost)); strings.Contains(out.stdout, "public") {
		t.Errorf("a pooled sandbox without a network reached the public host: %q", out.stdout)
	}

	// The template imported again: what the pool holds is stale.
	waitFor("refilled", ready)
	layer := testutil.Layer(t, testutil.LayerTar(t, []testutil.TarEntry{{Name: "etc/os-release", Body: []byte("ID=changed\n")}}))
	img, err := mutate.AppendLayers(testutil.TestImage(t), layer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Templates.Import(context.Background(), testutil.WriteDockerArchive(t, img, "cage-test:"+name+"-changed"), name, imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	waitFor("drained its stale sandbox", func(s sandbox.PoolStat) bool { return s.Stale >= 1 })
	waitFor("refilled", ready)
	b = create(sandbox.Options{}, true)
	if got := b.mustSh("head -1 /etc/os-release"); got != "ID=changed\n" {
		t.Errorf("after the template changed, a pooled create ran in %q; want the new files", got)
	}
	if w.name == "microvm" {
		return // a new agent is a new initramfs and snapshot: a cold boot under TCG
	}

	// The agent binary changes (a new cage installed, as installers do: a
	// new file renamed over the old, which a running agent may still be):
	// stale too.
	waitFor("refilled", ready)
	if err := copyExec(shared.AgentPath, agent+".new"); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(agent+".new", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.Write([]byte("changed"))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(agent+".new", agent)
	}
	if err != nil {
		t.Fatal(err)
	}
	waitFor("drained its sandbox of the old agent", func(s sandbox.PoolStat) bool { return s.Stale >= 2 })
	waitFor("refilled", ready)
	create(sandbox.Options{}, true).mustSh("true")
}

func insideAgentThreads() int64 { return int64(inside.AgentThreads) }

// readPids lists the processes of the group at dir (cgroup.procs).
func readPids(dir string) []int {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// cpuWeight is the CPU weight of the group whose cpu controller directory
// is dir: cpu.shares on v1, cpu.weight on v2 ("" when neither reads).
func cpuWeight(t *testing.T, dir string) string {
	for _, f := range []string{"cpu.shares", "cpu.weight"} {
		if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	if t != nil {
		t.Errorf("no CPU weight in %s", dir)
	}
	return ""
}

// niceOf is the nice value of a thread of process pid that is not 0 (0
// when none).
func niceOf(t *testing.T, pid int) int {
	// A process that is exiting has given up its memory already (its
	// command line reads empty, its status has no VmSize) while its
	// threads are not zombies yet: it runs nothing more, its nice is moot.
	if status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err != nil || !strings.Contains(string(status), "\nVmSize:") {
		return 0
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, task := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			continue // gone
		}
		// Fields after the command's closing parenthesis: the state is the
		// 3rd field, nice the 19th. A thread that has exited (a zombie,
		// whose command line reads empty) runs nothing: its nice is moot.
		f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
		if len(f) > 0 && (f[0] == "Z" || f[0] == "X") {
			continue
		}
		if len(f) > 16 && f[16] != "0" {
			n := 0
			fmt.Sscan(f[16], &n)
			return n
		}
	}
	return 0
}

// lastingNice is pid's nice (as niceOf) after up to wait: 0 as soon as the
// process has gone, is exiting or is no longer niced.
func lastingNice(pid int, wait time.Duration) int {
	deadline := time.Now().Add(wait)
	for {
		n := niceOf(nil, pid)
		if n <= 1 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func copyExec(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, data, 0o755)
}

// writerFunc is an io.Writer of a function.
type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
