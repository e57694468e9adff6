package daemontest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/apispec"
)

// TestCrashRestart kills the daemon with SIGKILL under a running sandbox:
// the sandbox keeps running without it, and the next daemon adopts it with
// its files, its deadline and its processes, and can kill it. A sandbox
// whose deadline passed while no daemon ran is removed by the next one.
func TestCrashRestart(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	key := d.key
	sb := d.create(t, key, map[string]any{"timeout": 600, "metadata": map[string]string{"survive": "yes"}})
	short := d.create(t, key, map[string]any{"timeout": 2})
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	upload(t, ac, "/tmp/keep.txt", []byte("written before the crash\n"))
	mustRun(t, ac, "nohup sleep 600 >/dev/null 2>&1 &")
	before := d.get(t, key, sb.SandboxID)
	agent := agentOf(t, sb.SandboxID)
	start := startTime(agent)

	d.kill9(t)

	// Without a daemon, the sandbox lives on: its agent is the same process
	// and answers on its socket.
	if startTime(agent) != start || start == "" {
		t.Fatalf("the agent of sandbox %s (pid %d) died with the daemon", sb.SandboxID, agent)
	}
	sock := filepath.Join(d.runDir, "sandboxes", sb.SandboxID, "agent.sock")
	direct := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var dl net.Dialer
		return dl.DialContext(ctx, "unix", sock)
	}, sb.EnvdAccessToken)
	if out := mustRun(t, direct, "cat /tmp/keep.txt; pgrep -x sleep >/dev/null && echo sleeping"); out != "written before the crash\nsleeping\n" {
		t.Errorf("the sandbox's agent, reached on its socket while no daemon runs: %q", out)
	}
	direct.Close()
	// Let the short sandbox's deadline pass while nothing watches it.
	time.Sleep(3 * time.Second)

	d.start(t)
	ls := d.list(t, key, nil)
	if ids := idsOf(ls); !slices.Equal(ids, []string{sb.SandboxID}) {
		t.Errorf("after the restart the daemon lists %v, want only %s (%s timed out while it was down)", ids, sb.SandboxID, short.SandboxID)
	}
	got := d.get(t, key, sb.SandboxID)
	if !got.EndAt.Equal(before.EndAt) || !got.StartedAt.Equal(before.StartedAt) || got.Metadata["survive"] != "yes" ||
		got.EnvdAccessToken != sb.EnvdAccessToken {
		t.Errorf("after the restart: %+v; before: %+v", got, before)
	}
	ac2 := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac2.Close()
	if b := download(t, ac2, "/tmp/keep.txt"); string(b) != "written before the crash\n" {
		t.Errorf("the file written before the crash reads %q after it", b)
	}
	if out := mustRun(t, ac2, "echo after; pgrep -x sleep >/dev/null && echo sleeping"); out != "after\nsleeping\n" {
		t.Errorf("a command after the restart: %q", out)
	}
	if m := d.metrics(t, key, sb.SandboxID); m.MemUsed <= 0 {
		t.Errorf("metrics of an adopted sandbox: %+v", m)
	}
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/timeout", key: key,
		body: map[string]any{"timeout": 300}})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/sandboxes/" + short.SandboxID, key: key})
	d.checkGone(t, short.SandboxID, 5*time.Second)

	d.kill(t, key, sb.SandboxID)
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/sandboxes/" + sb.SandboxID, key: key})
	d.checkGone(t, sb.SandboxID, 5*time.Second)
	if eventually(5*time.Second, func() string {
		if startTime(agent) == start {
			return "alive"
		}
		return ""
	}) != "" {
		t.Errorf("the agent (pid %d) of the killed adopted sandbox is still running", agent)
	}
	if left := d.sandboxDirs(); len(left) != 0 {
		t.Errorf("left in %s/sandboxes: %v", d.runDir, left)
	}
}

// agentOf returns the host pid of sandbox id's agent: the process in its
// cgroup that is PID 1 of its namespace.
func agentOf(t *testing.T, id string) int {
	t.Helper()
	for _, dir := range cgroupDirs(id) {
		for _, pid := range readPids(filepath.Join(dir, "cgroup.procs")) {
			if p, ok := readProc(pid); ok && p.pid1() {
				return pid
			}
		}
	}
	t.Fatalf("no agent in the cgroups of sandbox %s (%v)", id, cgroupDirs(id))
	return 0
}

// startTime is field 22 of /proc/PID/stat ("" once the process is gone).
func startTime(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// TestCrashDuringCreates kills the daemon with SIGKILL in the middle of
// creates, over and over, then checks that the last daemon made the host
// agree with what it lists: every listed sandbox works, every create that was
// answered 201 is listed, and no directory, cgroup or process of a sandbox is
// left that it does not list.
func TestCrashDuringCreates(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	key := d.key

	var mu sync.Mutex
	seen := map[string]bool{}     // every id that showed up in RUN_DIR/sandboxes
	answered := map[string]bool{} // creates answered 201
	stopWatch := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			ents, _ := os.ReadDir(filepath.Join(d.runDir, "sandboxes"))
			mu.Lock()
			for _, e := range ents {
				seen[e.Name()] = true
			}
			mu.Unlock()
			select {
			case <-stopWatch:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()

	hc := &http.Client{Timeout: 30 * time.Second}
	for round := 0; round < 10; round++ {
		if round > 0 {
			d.start(t)
		}
		var wg sync.WaitGroup
		for i := 0; i < 4; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if id := createRaw(t, d, hc, key); id != "" {
					d.remember(id, key)
					mu.Lock()
					answered[id] = true
					mu.Unlock()
				}
			}()
		}
		time.Sleep(time.Duration(rand.IntN(151)) * time.Millisecond)
		d.kill9(t)
		wg.Wait()
	}
	d.start(t)

	mine := func(id string) bool {
		mu.Lock()
		defer mu.Unlock()
		if seen[id] || answered[id] {
			return true
		}
		_, err := os.Lstat(filepath.Join(d.runDir, "sandboxes", id))
		return err == nil
	}
	var lst map[string]types.ListedSandbox
	problems := eventually(10*time.Second, func() string {
		lst = map[string]types.ListedSandbox{}
		for _, l := range d.list(t, key, nil) {
			lst[l.SandboxID] = l
		}
		return d.disagreements(t, lst, answered, &mu, mine)
	})
	procs, sockets, ours := sandboxProcs(), unixSockets(d.runDir), 0
	for _, p := range procs {
		if owner, _ := ownerOf(p, procs, sockets); owner != "" && mine(owner) {
			ours++
		}
	}
	mu.Lock()
	t.Logf("%d sandbox directories seen, %d creates answered 201, %d sandboxes listed after the last restart, "+
		"%d processes in sandbox uid ranges on the host, %d of them this run directory's",
		len(seen), len(answered), len(lst), len(procs), ours)
	mu.Unlock()
	if problems != "" {
		t.Errorf("10 s after the last restart the host and the daemon still disagree:\n%s", problems)
	}

	// Kill everything; then nothing at all is left.
	for id := range lst {
		d.kill(t, key, id)
	}
	close(stopWatch)
	<-watched
	if ls := d.list(t, key, nil); len(ls) != 0 {
		t.Errorf("after killing every sandbox, listed: %v", idsOf(ls))
	}
	if why := eventually(5*time.Second, func() string {
		return d.disagreements(t, map[string]types.ListedSandbox{}, nil, &mu, mine)
	}); why != "" {
		t.Errorf("after killing every listed sandbox, left on the host:\n%s", why)
	}
}

// createRaw sends one create; it returns the id when answered 201 and ""
// when the request died with the daemon.
func createRaw(t *testing.T, d *daemon, hc *http.Client, key string) string {
	body, _ := json.Marshal(map[string]any{"templateID": "host", "timeout": 600})
	req, _ := http.NewRequest(http.MethodPost, d.apiURL()+"/v2/sandboxes", bytes.NewReader(body))
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Content-Type", "application/json")
	if err := apispec.ValidateRequest(req, body); err != nil {
		t.Errorf("the test's own request breaks the document: %v", err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return "" // the daemon was killed under it
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return ""
	}
	if err := apispec.ValidateResponse(req, resp.StatusCode, resp.Header, data); err != nil {
		t.Errorf("create during the crashes: %v", err)
	}
	if resp.StatusCode != http.StatusCreated {
		t.Errorf("create during the crashes: %d %s", resp.StatusCode, data)
		return ""
	}
	var sb types.Sandbox
	if err := json.Unmarshal(data, &sb); err != nil || sb.SandboxID == "" {
		t.Errorf("create during the crashes: %v: %s", err, data)
		return ""
	}
	return sb.SandboxID
}

// disagreements describes where the host and the list differ ("" when they
// agree): a listed sandbox that does not run `true` through the proxy, an
// acknowledged create not listed, a directory in RUN_DIR/sandboxes or a
// cgroup of one of this run directory's sandboxes that is not listed, and a
// process in the sandbox uid ranges that belongs to this run directory and is
// not an agent of a listed sandbox or one of its descendants.
func (d *daemon) disagreements(t *testing.T, listed map[string]types.ListedSandbox, answered map[string]bool, mu *sync.Mutex, mine func(string) bool) string {
	var out []string
	for id := range listed {
		// Lists do not carry the access token; the sandbox's detail does.
		ac := d.agent(id, d.get(t, d.key, id).EnvdAccessToken)
		r := run(ac, "true")
		ac.Close()
		if r.err != nil || r.exit != 0 {
			out = append(out, fmt.Sprintf("listed sandbox %s does not run `true`: exit %d, %v", id, r.exit, r.err))
		}
	}
	mu.Lock()
	for id := range answered {
		if _, ok := listed[id]; !ok {
			out = append(out, fmt.Sprintf("sandbox %s was answered 201 but is not listed", id))
		}
	}
	mu.Unlock()
	for _, id := range d.sandboxDirs() {
		if _, ok := listed[id]; !ok {
			out = append(out, fmt.Sprintf("directory %s of an unlisted sandbox (%s)", filepath.Join(d.runDir, "sandboxes", id), describeDir(filepath.Join(d.runDir, "sandboxes", id))))
		}
	}
	for _, name := range cageGroups() {
		if _, ok := listed[name]; !ok && mine(name) {
			out = append(out, fmt.Sprintf("cgroups of an unlisted sandbox: %v (processes %v)", cgroupDirs(name), cgroupProcs(name)))
		}
	}
	procs := sandboxProcs()
	sockets := unixSockets(d.runDir)
	for _, p := range procs {
		owner, how := ownerOf(p, procs, sockets)
		if owner == "" || !mine(owner) {
			continue // not this run directory's (other tests run sandboxes too)
		}
		if _, ok := listed[owner]; !ok {
			out = append(out, fmt.Sprintf("process %d (%s, uid %d, ppid %d) of unlisted sandbox %s (by %s)", p.pid, p.comm, p.uid, p.ppid, owner, how))
			continue
		}
		if !underAgent(p, procs, owner) {
			out = append(out, fmt.Sprintf("process %d (%s, uid %d, ppid %d) in listed sandbox %s is not its agent or a descendant of it", p.pid, p.comm, p.uid, p.ppid, owner))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// ownerOf names the sandbox a process belongs to: by its cage cgroup, else
// its nearest ancestor's, else the agent socket under the run directory it
// holds.
func ownerOf(p proc, procs map[int]proc, sockets map[string]string) (id, how string) {
	for q, depth := p, 0; depth < 64; depth++ {
		if q.cgroup != "" {
			if depth == 0 {
				return q.cgroup, "its cgroup"
			}
			return q.cgroup, "its ancestor's cgroup"
		}
		if q.ppid <= 1 {
			break
		}
		next, ok := procs[q.ppid]
		if !ok {
			if next, ok = readProc(q.ppid); !ok {
				break
			}
		}
		q = next
	}
	if path := socketOwner(p.pid, sockets); path != "" {
		return filepath.Base(filepath.Dir(path)), "the agent socket it holds, " + path
	}
	return "", ""
}

// underAgent reports whether p is the agent of sandbox id or descends from
// it.
func underAgent(p proc, procs map[int]proc, id string) bool {
	for q, depth := p, 0; depth < 64; depth++ {
		if q.pid1() && q.cgroup == id {
			return true
		}
		next, ok := procs[q.ppid]
		if !ok {
			return false
		}
		q = next
	}
	return false
}

// cageGroups names the sandbox cgroups under the cage parent, in every
// hierarchy.
func cageGroups() []string {
	names := map[string]bool{}
	for _, pattern := range []string{"/sys/fs/cgroup/*/cage/*", "/sys/fs/cgroup/cage/*"} {
		paths, _ := filepath.Glob(pattern)
		for _, p := range paths {
			if fi, err := os.Stat(p); err == nil && fi.IsDir() {
				names[filepath.Base(p)] = true
			}
		}
	}
	var out []string
	for n := range names {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func cgroupProcs(id string) []int {
	var pids []int
	for _, dir := range cgroupDirs(id) {
		for _, pid := range readPids(filepath.Join(dir, "cgroup.procs")) {
			if !slices.Contains(pids, pid) {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

// describeDir says how old a directory is and what it holds.
func describeDir(dir string) string {
	fi, err := os.Stat(dir)
	if err != nil {
		return err.Error()
	}
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return "age " + time.Since(fi.ModTime()).Round(time.Millisecond).String() + ", holds " + strings.Join(names, " ") +
		", cgroup processes " + strconv.Itoa(len(cgroupProcs(filepath.Base(dir))))
}
