package conformance

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	cagewall "github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// TestLeakCheck creates and destroys many sandboxes, some of them killed by
// their limits or destroyed mid-command, and checks that the host is left as
// it was: no processes in sandbox uid ranges, no state files, no cgroups, no
// mounts, no namespaces, no interfaces or nftables rules, no file
// descriptors or goroutines in the caller.
func TestLeakCheck(t *testing.T) {
	leakCheck(t, "process", 200, 4, func(i int) leakKind {
		switch i % 10 {
		case 1:
			return leakOOM
		case 3:
			return leakPids
		case 5:
			return leakTimeout
		case 6:
			return leakTemplate
		case 7:
			return leakDestroyRunning
		case 8:
			return leakNetwork
		case 9:
			return leakNetDestroy
		}
		return leakTrue
	})
}

// TestLeakCheckOCIWalls is the same check on the runc and gVisor walls,
// with fewer sandboxes (each costs a runtime's start). Under gVisor the OOM
// and pids kinds are left out: there they take the whole sentry down, which
// the hostile table covers.
func TestLeakCheckOCIWalls(t *testing.T) {
	for _, w := range walls() {
		if w.name == "process" {
			continue
		}
		t.Run(w.name, func(t *testing.T) {
			h := processHost(t)
			if err := h.WallMissing(w.name); err != nil {
				w.newBox(t, sandbox.Options{}) // skips (or fails where required) with the reason
			}
			kinds := []leakKind{leakTrue, leakOOM, leakNetwork, leakPids, leakTimeout, leakDestroyRunning, leakNetDestroy, leakTemplate}
			n := 48
			if w.name == "gvisor" {
				kinds, n = []leakKind{leakTrue, leakTimeout, leakDestroyRunning, leakNetwork, leakNetDestroy, leakTemplate}, 18
			}
			if w.name == "microvm" {
				n = 24 // each a VM restored under TCG
			}
			leakCheck(t, w.name, n, 2, func(i int) leakKind { return kinds[i%len(kinds)] })
		})
	}
}

func leakCheck(t *testing.T, wallName string, total, workers int, kindOf func(int) leakKind) {
	h, _ := netHost(t)
	importTestImage(t)

	// Warm up: the first sandbox creates RUN_DIR/sandboxes, RUN_DIR/ids and
	// the cgroup parents, which stay; the runtime starts its helpers.
	// On the microvm wall the first sandbox of each VM shape (template,
	// memory, NIC) makes its snapshot, whose RAM this process keeps.
	warm := &leakRun{h: h, wall: wallName, ids: map[string]bool{}}
	warmKinds := []leakKind{leakTrue, leakDestroyRunning, leakNetwork, leakTemplate}
	if wallName == "microvm" {
		warmKinds = append(warmKinds, leakOOM)
	}
	for _, k := range warmKinds {
		if err := warm.one(k); err != nil {
			t.Fatalf("warm-up %s: %v", k, err)
		}
	}
	// With pools on (CAGE_TEST_POOLS), the baseline has none; the pools
	// run through the workload and are stopped before the final count.
	h.StopPools()
	base := takeLeakSnapshot(h.RunDir)
	t.Logf("baseline: %s", base.summary())
	testPools(t, h, wallName)

	kinds := make([]leakKind, 0, total)
	for i := range total {
		kinds = append(kinds, kindOf(i))
	}
	run := &leakRun{h: h, wall: wallName, ids: map[string]bool{}}
	start := time.Now()
	work := make(chan leakKind)
	var wg sync.WaitGroup
	var mu sync.Mutex
	counts := map[leakKind]int{}
	var failures []string
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range work {
				err := run.one(k)
				mu.Lock()
				counts[k]++
				if err != nil {
					failures = append(failures, fmt.Sprintf("%s: %v", k, err))
				}
				mu.Unlock()
			}
		}()
	}
	for _, k := range kinds {
		work <- k
	}
	close(work)
	wg.Wait()
	took := time.Since(start)
	for _, f := range failures {
		t.Error(f)
	}
	for _, k := range []leakKind{leakTrue, leakOOM, leakPids, leakTimeout, leakDestroyRunning, leakNetwork, leakNetDestroy, leakTemplate} {
		t.Logf("%-17s %3d sandboxes", k, counts[k])
	}
	t.Logf("leak check: %d sandboxes created and destroyed in %v (%d workers)", len(run.ids), took.Round(time.Millisecond), workers)
	if len(run.ids) != total {
		t.Errorf("created %d sandboxes, want %d", len(run.ids), total)
	}
	for id := range warm.ids {
		run.ids[id] = true
	}
	h.StopPools()

	// Everything must be back as it was. The kernel frees some things (net
	// namespaces) asynchronously, and other processes on the host may have
	// sandboxes of their own coming and going: poll a while before failing.
	deadline := time.Now().Add(10 * time.Second)
	for {
		after := takeLeakSnapshot(h.RunDir)
		leaks, foreign := compareLeakSnapshots(base, after, run.ids)
		if len(leaks) == 0 && len(foreign) == 0 {
			t.Logf("after: %s", after.summary())
			return
		}
		if time.Now().After(deadline) {
			t.Logf("after: %s", after.summary())
			for _, f := range foreign {
				t.Logf("not from this test (ignored): %s", f)
			}
			for _, l := range leaks {
				t.Errorf("leak: %s", l)
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type leakKind string

const (
	leakTrue           leakKind = "true"
	leakOOM            leakKind = "oom"
	leakPids           leakKind = "pids-limit"
	leakTimeout        leakKind = "timeout"
	leakDestroyRunning leakKind = "destroy-running"
	leakNetwork        leakKind = "network"     // internet mode, fetches from the test world
	leakNetDestroy     leakKind = "net-destroy" // internet mode, destroyed under a running command
	leakTemplate       leakKind = "template"    // an image template, writes to its root
)

type leakRun struct {
	h    *sandbox.Host
	wall string
	mu   sync.Mutex
	ids  map[string]bool // every sandbox created
}

// one creates a sandbox, runs a workload of kind k in it and destroys it,
// checking that each went as it should.
func (r *leakRun) one(k leakKind) (err error) {
	o := sandbox.Options{Wall: r.wall}
	switch k {
	case leakOOM:
		o.Memory = 48 << 20
	case leakPids:
		o.Pids = 20
	case leakNetwork, leakNetDestroy:
		o.Net = network.Policy{Mode: network.Internet}
	case leakTemplate:
		o.Template = testTemplate
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sb, err := r.h.Create(ctx, o)
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	r.mu.Lock()
	r.ids[sb.ID()] = true
	r.mu.Unlock()
	c := agentclient.New(sb.Dial, sb.Token())
	defer func() {
		c.Close()
		if derr := sb.Destroy(); derr != nil {
			err = errors.Join(err, fmt.Errorf("destroy %s: %w", sb.ID(), derr))
		}
		err = errors.Join(err, leakDestroyed(r.h, sb))
	}()

	opts := agentclient.RunOptions{Stdout: io.Discard, Stderr: io.Discard}
	want := ""
	switch k {
	case leakTrue:
		opts.Cmd, want = "true", "exited"
	case leakOOM:
		opts.Cmd, opts.Args, want = "python3", []string{"-c", "b = bytearray(200*1024*1024)"}, "oom"
	case leakPids:
		opts.Cmd, opts.Args, want = "/bin/sh", []string{"-c", "while :; do sleep 30 & done"}, "pids_limit"
	case leakTimeout:
		opts.Cmd, opts.Args, opts.TimeoutMs, want = "sleep", []string{"30"}, 200, "timeout"
	case leakNetwork:
		opts.Cmd, opts.Args, want = "python3", []string{"-c", fmt.Sprintf(
			"import urllib.request; assert urllib.request.urlopen('http://%s/', timeout=10).read().startswith(b'public')", testutil.PublicHost)}, "exited"
	case leakTemplate:
		opts.Cmd, opts.Args, want = "/bin/sh", []string{"-c", "echo x > /usr/local/share/f && echo y > /home/user/f"}, "exited"
		opts.User = "root"
	case leakDestroyRunning, leakNetDestroy:
		return leakDestroyWhileRunning(ctx, sb, c)
	}
	end, err := c.Run(ctx, opts)
	if err != nil {
		return fmt.Errorf("run %s: %w", opts.Cmd, err)
	}
	if end.GetReason() != want {
		return fmt.Errorf("%s ended with %+v, want reason %q", opts.Cmd, end, want)
	}
	return nil
}

// leakDestroyWhileRunning starts `sleep 100` and destroys the sandbox under it.
func leakDestroyWhileRunning(ctx context.Context, sb cagewall.Sandbox, c *agentclient.Client) error {
	started := make(chan struct{})
	var once sync.Once
	done := make(chan error, 1)
	go func() {
		end, err := c.Run(ctx, agentclient.RunOptions{
			Cmd: "sleep", Args: []string{"100"}, Stdout: io.Discard, Stderr: io.Discard,
			OnStart: func(uint32) { once.Do(func() { close(started) }) },
		})
		if err == nil {
			err = fmt.Errorf("ended with %+v", end)
		}
		done <- err
	}()
	select {
	case <-started:
	case err := <-done:
		return fmt.Errorf("sleep 100 did not start: %v", err)
	case <-time.After(30 * time.Second):
		return errors.New("sleep 100 did not start in 30s")
	}
	if err := sb.Destroy(); err != nil {
		return fmt.Errorf("destroy under a running command: %w", err)
	}
	select {
	case <-done: // the stream broke, as it must
	case <-time.After(30 * time.Second):
		return errors.New("Run did not return after the sandbox was destroyed")
	}
	select {
	case <-sb.Exited():
	default:
		return errors.New("Destroy returned before the agent was reaped")
	}
	return nil
}

// leakDestroyed checks that Destroy removed the sandbox's state directory and
// its cgroups before it returned.
func leakDestroyed(h *sandbox.Host, sb cagewall.Sandbox) error {
	var errs []error
	if _, err := os.Stat(filepath.Join(h.RunDir, "sandboxes", sb.ID())); !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("%s: state directory still there after Destroy", sb.ID()))
	}
	if cg := sb.Cgroup(); cg != nil {
		for _, ctrl := range []string{"memory", "cpu", "pids"} {
			if dir := cg.Dir(ctrl); dir != "" {
				if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
					errs = append(errs, fmt.Errorf("%s: cgroup %s still there after Destroy", sb.ID(), dir))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// leakIDBase is the first host uid of the sandboxes' uid ranges.
const leakIDBase = 1 << 20

var leakNSTypes = []string{"user", "mnt", "pid", "net", "ipc", "uts", "cgroup"}

type leakProc struct {
	pid, ppid, uid int
	cmd            string
	cgroup         string // the sandbox id of the cage cgroup it is in, if any
}

// leakSnapshot is what the host holds that a sandbox could leave behind.
type leakSnapshot struct {
	procs      map[int]leakProc    // every process (for attribution)
	sandboxes  []string            // RUN_DIR/sandboxes
	ids        []string            // RUN_DIR/ids
	idHolders  map[string][]int    // RUN_DIR/ids: who holds each lock (/proc/locks)
	cgroups    map[string][]string // sandbox cgroups under the cage parent: name -> dirs
	mounts     []string            // host mounts mentioning the run dir
	ns         map[string]map[string][]int
	fds        int
	goroutines int
	links      []int // host interfaces cage<slot>
	rules      []int // slots with chains in the nftables table
}

func takeLeakSnapshot(runDir string) *leakSnapshot {
	s := &leakSnapshot{procs: map[int]leakProc{}, cgroups: map[string][]string{}, ns: map[string]map[string][]int{}}
	for _, typ := range leakNSTypes {
		s.ns[typ] = map[string][]int{}
	}
	s.sandboxes = leakDirNames(filepath.Join(runDir, "sandboxes"))
	s.ids = leakDirNames(state.IDLockDir)
	s.idHolders = lockHolders(state.IDLockDir, s.ids)
	for _, pattern := range []string{"/sys/fs/cgroup/*/cage/*", "/sys/fs/cgroup/cage/*"} {
		paths, _ := filepath.Glob(pattern)
		for _, p := range paths {
			if fi, err := os.Stat(p); err == nil && fi.IsDir() {
				s.cgroups[filepath.Base(p)] = append(s.cgroups[filepath.Base(p)], p)
			}
		}
	}
	if data, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, runDir) {
				s.mounts = append(s.mounts, line)
			}
		}
	}
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		p, ok := leakReadProc(pid)
		if !ok {
			continue
		}
		s.procs[pid] = p
		for _, typ := range leakNSTypes {
			if l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, typ)); err == nil {
				s.ns[typ][l] = append(s.ns[typ][l], pid)
			}
		}
	}
	s.links = network.HostLinks()
	s.rules, _ = network.TableSlots()
	slices.Sort(s.links)
	slices.Sort(s.rules)
	runtime.GC()
	s.fds = len(leakDirNames("/proc/self/fd"))
	s.goroutines = runtime.NumGoroutine()
	return s
}

func leakDirNames(dir string) []string {
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, d := range ents {
		names = append(names, d.Name())
	}
	return names
}

func leakReadProc(pid int) (leakProc, bool) {
	p := leakProc{pid: pid, uid: -1}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return p, false
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		f := strings.Fields(v)
		switch k {
		case "Name":
			p.cmd = strings.TrimSpace(v)
		case "PPid":
			p.ppid, _ = strconv.Atoi(strings.TrimSpace(v))
		case "Uid":
			if len(f) > 0 {
				p.uid, _ = strconv.Atoi(f[0])
			}
		}
	}
	if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err == nil {
		for _, line := range strings.Split(string(cg), "\n") {
			if _, path, ok := strings.Cut(line, ":cage/"); ok {
				p.cgroup, _, _ = strings.Cut(path, "/")
				break
			}
			if i := strings.Index(line, "/cage/"); i >= 0 {
				p.cgroup, _, _ = strings.Cut(line[i+len("/cage/"):], "/")
				break
			}
		}
	}
	return p, true
}

// ours reports whether a process comes from this test: a descendant of the
// test process (every sandbox's agent is its child) or a member of one of
// the sandboxes it created.
func (s *leakSnapshot) ours(pid int, ids map[string]bool) bool {
	self := os.Getpid()
	for range 64 {
		p, ok := s.procs[pid]
		if !ok {
			return false
		}
		if ids[p.cgroup] || p.ppid == self {
			return true
		}
		if p.ppid <= 1 {
			return false
		}
		pid = p.ppid
	}
	return false
}

func (s *leakSnapshot) summary() string {
	sandboxProcs := 0
	for _, p := range s.procs {
		if p.uid >= leakIDBase {
			sandboxProcs++
		}
	}
	var ns []string
	for _, typ := range leakNSTypes {
		ns = append(ns, fmt.Sprintf("%s=%d", typ, len(s.ns[typ])))
	}
	return fmt.Sprintf("%d sandbox-uid processes, %d state dirs, %d uid locks, %d cage cgroups, %d run-dir mounts, namespaces %s, %d veths, %d rule sets, %d fds, %d goroutines",
		sandboxProcs, len(s.sandboxes), len(s.ids), len(s.cgroups), len(s.mounts), strings.Join(ns, " "), len(s.links), len(s.rules), s.fds, s.goroutines)
}

// compareLeakSnapshots lists what after holds beyond base: leaks attributable to
// the sandboxes in ids (or to state only this test writes), and differences
// that belong to other processes of the host.
func compareLeakSnapshots(base, after *leakSnapshot, ids map[string]bool) (leaks, foreign []string) {
	if !slices.Equal(base.sandboxes, after.sandboxes) {
		leaks = append(leaks, fmt.Sprintf("RUN_DIR/sandboxes holds %v, was %v", after.sandboxes, base.sandboxes))
	}
	// The uid-range locks are the host's, shared with every other cage on
	// it: a lock that went is no leak, and one another process holds is
	// that process's.
	for _, id := range after.ids {
		if slices.Contains(base.ids, id) {
			continue
		}
		holders := after.idHolders[id]
		mine := len(holders) == 0 // a lock file left behind
		for _, pid := range holders {
			mine = mine || pid == os.Getpid() || after.ours(pid, ids)
		}
		desc := fmt.Sprintf("uid-range lock %s (held by %v; locks %v, were %v)", id, holders, after.ids, base.ids)
		if mine {
			leaks = append(leaks, desc)
		} else {
			foreign = append(foreign, desc)
		}
	}
	// The test runs in a network namespace of its own: every interface and
	// rule there is its sandboxes'.
	if !slices.Equal(base.links, after.links) {
		leaks = append(leaks, fmt.Sprintf("host interfaces of slots %v, was %v", after.links, base.links))
	}
	if !slices.Equal(base.rules, after.rules) {
		leaks = append(leaks, fmt.Sprintf("nftables chains of slots %v, was %v", after.rules, base.rules))
	}
	if !slices.Equal(base.mounts, after.mounts) {
		leaks = append(leaks, fmt.Sprintf("host mounts of the run dir: %q, was %q", after.mounts, base.mounts))
	}
	for name, dirs := range after.cgroups {
		if _, ok := base.cgroups[name]; ok {
			continue
		}
		if ids[name] {
			leaks = append(leaks, fmt.Sprintf("cgroup of sandbox %s: %v", name, dirs))
		} else {
			foreign = append(foreign, fmt.Sprintf("cgroup %v", dirs))
		}
	}
	for pid, p := range after.procs {
		if p.uid < leakIDBase {
			continue
		}
		if b, ok := base.procs[pid]; ok && b.uid == p.uid && b.ppid == p.ppid {
			continue
		}
		desc := fmt.Sprintf("process %d (%s, uid %d, parent %d, cgroup %q)", pid, p.cmd, p.uid, p.ppid, p.cgroup)
		if after.ours(pid, ids) {
			leaks = append(leaks, desc)
		} else {
			foreign = append(foreign, desc)
		}
	}
	for _, typ := range leakNSTypes {
		grew := len(after.ns[typ]) > len(base.ns[typ])
		for ns, holders := range after.ns[typ] {
			if _, ok := base.ns[typ][ns]; ok {
				continue
			}
			desc := fmt.Sprintf("%s held by %v (%d %s namespaces, was %d)", ns, holders, len(after.ns[typ]), typ, len(base.ns[typ]))
			mine := false
			for _, pid := range holders {
				mine = mine || after.ours(pid, ids)
			}
			switch {
			case mine:
				leaks = append(leaks, desc)
			case grew:
				foreign = append(foreign, desc)
			}
		}
	}
	const slack = 10
	if after.fds > base.fds+slack {
		leaks = append(leaks, fmt.Sprintf("%d open fds in the test process, was %d", after.fds, base.fds))
	}
	if after.goroutines > base.goroutines+slack {
		buf := make([]byte, 1<<16)
		buf = buf[:runtime.Stack(buf, true)]
		leaks = append(leaks, fmt.Sprintf("%d goroutines, was %d:\n%s", after.goroutines, base.goroutines, buf))
	}
	return leaks, foreign
}

// lockHolders maps each file of names in dir to the processes /proc/locks
// says hold a lock on it.
func lockHolders(dir string, names []string) map[string][]int {
	byInode := map[uint64]string{}
	for _, n := range names {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(dir, n), &st) == nil {
			byInode[st.Ino] = n
		}
	}
	out := map[string][]int{}
	b, _ := os.ReadFile("/proc/locks")
	for _, line := range strings.Split(string(b), "\n") {
		// 1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		pid, err := strconv.Atoi(f[4])
		parts := strings.Split(f[5], ":")
		if err != nil || len(parts) != 3 {
			continue
		}
		ino, err := strconv.ParseUint(parts[2], 10, 64)
		if n, ok := byInode[ino]; ok && err == nil {
			out[n] = append(out[n], pid)
		}
	}
	return out
}
