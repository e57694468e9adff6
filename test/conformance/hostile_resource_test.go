package conformance

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// Resource-exhaustion rows.

func resourceRows() []hostileRow {
	return []hostileRow{
		{
			name:   "fork_bomb",
			expect: "with pids=64 the bomb ends by timeout or pids_limit; the host forks, a sandbox created meanwhile runs commands, the bombed sandbox answers afterwards or is destroyed cleanly",
			opts:   &sandbox.Options{Pids: 64},
			custom: forkBomb,
			mayDie: true,
			on:     map[string]wallOutcome{"gvisor": sentryMayDie(`:(){ :|:& };:; sleep 30`, 2*time.Second)},
		},
		{
			name:   "pids_exhausted_agent_busy",
			expect: "while the workload holds every pid of pids=32, the agent can still have its AgentThreads threads (process, runc: the host's group leaves it room for them), concurrent file-API and process requests fail or succeed cleanly; the agent survives and the workload's command ends normally",
			opts:   &sandbox.Options{Pids: 32},
			custom: pidsExhaustedAgentBusy,
			on: map[string]wallOutcome{"gvisor": sentryMayDie(
				`python3 -c 'import os,time
while True:
    try: os.fork() or time.sleep(60)
    except OSError: break
time.sleep(1)'`, 10*time.Second)},
		},
		{
			name:   "memory_bomb",
			expect: `touching 1 GiB with memory=64MiB: reason "oom", exit not 0, the agent survives`,
			opts:   &sandbox.Options{Memory: 64 << 20},
			argv:   py(`x = b"\x01" * (1 << 30); print("ALLOCATED", len(x))`),
			check: func(t *testing.T, r result) {
				if r.end.GetReason() != "oom" || r.code() == 0 || strings.Contains(r.stdout, "ALLOCATED") {
					t.Errorf(`want reason "oom" and a non-zero exit, got %+v`, r.end)
				}
			},
			on: map[string]wallOutcome{"gvisor": sentryMayDie(`python3 -c 'x = b"\x01" * (1 << 30); print("ALLOCATED", len(x))'`, 30*time.Second)},
		},
		{
			name:   "shm_bomb",
			expect: "1 GiB into /dev/shm with memory=128MiB (shm 32MiB): No space left on device; the agent survives",
			opts:   &sandbox.Options{Memory: 128 << 20},
			script: `head -c 1G /dev/zero > /dev/shm/fill; rc=$?; df -k /dev/shm | tail -1; rm -f /dev/shm/fill; exit $rc`,
			check:  fails("No space left on device", " 32768 "), // df -k: the tmpfs is 32 MiB
		},
		{
			name:   "disk_fill_bytes",
			expect: "1 GiB into /tmp with disk=32MiB: No space left on device; the agent survives and the space comes back",
			opts:   &sandbox.Options{Disk: 32 << 20},
			script: `head -c 1G /dev/zero > /tmp/fill; rc=$?; ls -s /tmp/fill; rm -f /tmp/fill; echo after > /home/user/after && cat /home/user/after; exit $rc`,
			check:  noneOf(fails("No space left on device", "after"), "1048576 /tmp/fill"),
		},
		{
			name:   "disk_fill_inodes",
			expect: "creating empty files with disk=8MiB (4096 inodes): ENOSPC; the agent survives",
			opts:   &sandbox.Options{Disk: 8 << 20},
			argv: py(`
n = 0
os.mkdir("/tmp/d")
try:
    while n < 1000000:
        os.close(os.open("/tmp/d/%d" % n, os.O_CREAT | os.O_WRONLY)); n += 1
    print("NO LIMIT")
except OSError as e:
    print("stopped after", n, errno.errorcode.get(e.errno)); sys.exit(1)
`),
			check: func(t *testing.T, r result) {
				noneOf(fails("ENOSPC"), "NO LIMIT")(t, r)
				var n int
				if _, err := fmt.Sscanf(r.stdout, "stopped after %d", &n); err != nil || n >= 4096 {
					t.Errorf("created %d files with 4096 inodes (%v)", n, err)
				}
			},
		},
		{
			name:   "agent_oom_score_adj",
			expect: "root cannot make the agent the OOM killer's victim: writing /proc/1/oom_score_adj fails, and after a memory bomb the agent still serves",
			users:  []string{"root"},
			opts:   &sandbox.Options{Memory: 64 << 20},
			script: `echo 1000 > /proc/1/oom_score_adj 2>/dev/null && echo "RAISED oom_score_adj"
echo 15 > /proc/1/oom_adj 2>/dev/null && echo "RAISED oom_adj"
python3 -c 'x = b"\x01" * (1 << 30)'`,
			check: noneOf(fails(), "RAISED"),
			on: map[string]wallOutcome{"gvisor": sentryMayDie(`echo 1000 > /proc/1/oom_score_adj 2>/dev/null
python3 -c 'x = b"\x01" * (1 << 30)'`, 30*time.Second)},
		},
		{
			name:   "fd_exhaustion",
			expect: "opening /dev/null until failure: EMFILE inside; the host still opens files",
			argv: py(`
fds = []
try:
    while len(fds) < 10000000:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    print("NO LIMIT")
except OSError as e:
    print("stopped after", len(fds), errno.errorcode.get(e.errno)); sys.exit(1)
`),
			check: func(t *testing.T, r result) {
				fails("EMFILE")(t, r)
				f, err := os.Open("/dev/null")
				if err != nil {
					t.Errorf("the host cannot open files: %v", err)
					return
				}
				f.Close()
			},
		},
		{
			name: "tcp_buffers",
			expect: "300 loopback TCP connections with 4 MiB buffers filled, memory=128MiB: what the kernel queues for the sandbox stays within its memory " +
				"(or the sandbox is the OOM killer's), never beyond (v1 charged TCP's buffers to no group: 256 MiB queued 2.2 GiB and filled the host's tcp_mem)",
			opts: &sandbox.Options{Memory: 128 << 20},
			argv: py(tcpFill),
			check: func(t *testing.T, r result) {
				if r.end.GetReason() == "oom" {
					return // the kernel charged it to the sandbox, which had no more
				}
				var mib int
				if _, err := fmt.Sscanf(r.stdout, "queued MiB %d", &mib); err != nil || mib > 160 {
					t.Errorf("the sandbox queued %d MiB in TCP buffers with 128 MiB of memory (%v; %q %q)", mib, err, r.stdout, r.stderr)
				}
			},
			on: map[string]wallOutcome{"gvisor": sentryMayDie("cat > /tmp/tcp.py <<'EOF'\n"+pyPrelude+tcpFill+"EOF\npython3 /tmp/tcp.py", 60*time.Second)},
		},
		{
			name: "kernel_memory_oom",
			expect: "unix sockets' queued bytes past memory=64MiB (the group's memory, no process's): the OOM killer takes the command (reason oom), " +
				"not the agent, and the sandbox serves on (the agent, the group's largest member, was its victim, and the sandbox died with it)",
			opts: &sandbox.Options{Memory: 64 << 20},
			argv: py(unixFill),
			check: func(t *testing.T, r result) {
				if r.end.GetReason() != "oom" || r.code() == 0 || strings.Contains(r.stdout, "HELD ALL") {
					t.Errorf(`want the command killed with reason "oom", got %+v err=%v stdout=%q`, r.end, r.err, r.stdout)
				}
			},
			on: map[string]wallOutcome{
				"gvisor": sentryMayDie("cat > /tmp/unix.py <<'EOF'\n"+pyPrelude+unixFill+"EOF\npython3 /tmp/unix.py", 60*time.Second),
				"microvm": {
					expect: "microvm: the guest's own kernel and memory: the command ends (oom, or its timeout while the guest reclaims under TCG) and the sandbox serves on",
					check: func(t *testing.T, r result) {
						if reason := r.end.GetReason(); (reason != "oom" && reason != "timeout") || strings.Contains(r.stdout, "HELD ALL") {
							t.Errorf(`want the command ended by "oom" or its timeout, got %+v err=%v stdout=%q`, r.end, r.err, r.stdout)
						}
					},
				},
			},
		},
		{
			name:   "output_flood",
			expect: "1 GiB on stdout with max_output=16MiB: truncated, exactly 16MiB forwarded, the test process's RSS grows < 200MiB",
			custom: outputFlood,
		},
		{
			name:   "orphans_ignoring_sigterm",
			expect: "setsid double-forked sleepers that ignore SIGTERM: after Destroy none of the sandbox's processes and no process with a host uid of its range remain",
			opts:   &sandbox.Options{},
			custom: orphansDie,
			mayDie: true,
		},
	}
}

// unixFill queues bytes in unix socket pairs until the sandbox has no
// memory left (3,000 pairs of about 200 KiB each).
const unixFill = `
held = []
for i in range(3000):
    a, b = socket.socketpair(); a.setblocking(False)
    try:
        while True: a.send(b"x" * 65536)
    except BlockingIOError:
        pass
    held.append((a, b))
print("HELD ALL")
`

// tcpFill fills 300 loopback TCP connections' buffers (4 MiB each way)
// and says how much the kernel queued.
const tcpFill = `
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(512)
held, total = [], 0
for i in range(300):
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        c.connect(srv.getsockname())
    except OSError:
        break
    s, _ = srv.accept(); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    c.setblocking(False); held.append((c, s))
    while True:
        try:
            total += c.send(b"x" * 65536)
        except OSError:
            break
print("queued MiB", total >> 20)
`

func forkBomb(t *testing.T, e *hostileEnv, b *box, user string) {
	done := make(chan result, 1)
	// The bomb runs in the background; the sleep keeps the command alive
	// until its timeout kills its process group, bomb included.
	go func() { done <- b.sh(`:(){ :|:& };:; sleep 30`, asUser(user), withTimeout(2*time.Second)) }()
	time.Sleep(500 * time.Millisecond)
	// Meanwhile: the host forks, and a new sandbox starts and runs commands.
	if out, err := exec.Command("/bin/sh", "-c", "echo forked").Output(); err != nil || string(out) != "forked\n" {
		t.Errorf("the host cannot fork during the bomb: %v %q", err, out)
	}
	other := e.w.newBox(t, sandbox.Options{})
	e.answers(t, other, "a sandbox created during the bomb")
	var r result
	select {
	case r = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the fork bomb did not end")
	}
	if reason := r.end.GetReason(); r.err != nil || (reason != "timeout" && reason != "pids_limit") {
		t.Errorf(`the bomb: want reason "timeout" or "pids_limit", got %+v err=%v`, r.end, r.err)
	}
	// The bombed sandbox answers (its remaining processes were killed with
	// the command's process group); failing that it must be destroyed cleanly.
	if a := b.sh("echo alive", withTimeout(20*time.Second)); a.err != nil || a.stdout != "alive\n" {
		t.Logf("the bombed sandbox does not answer (%v %+v); destroying it", a.err, a.end)
		if b.agentDied() {
			t.Errorf("the bomb killed the sandbox's agent: %v", b.sb.Err())
		}
		if err := b.sb.Destroy(); err != nil {
			t.Errorf("destroying the bombed sandbox: %v", err)
		}
		return
	}
	// The group's processes were killed; give the agent a moment to reap them.
	n := 0
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if n = len(b.sb.Cgroup().Procs()); n <= 2 {
			break
		}
	}
	if n > 2 {
		t.Errorf("%d processes remain in the bombed sandbox after the command ended", n)
	}
}

// countingWriter discards what it is given and counts it.
type countingWriter struct{ n int64 }

func (c *countingWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

// procStatusKB reads a "Key:   123 kB" line of /proc/self/status.
func procStatusKB(t *testing.T, key string) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+":"); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("%s: %q", key, line)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/self/status", key)
	return 0
}

func outputFlood(t *testing.T, e *hostileEnv, b *box, user string) {
	// Reset the peak RSS so that VmHWM afterwards is this probe's peak.
	_ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
	before := procStatusKB(t, "VmRSS")
	var out, errw countingWriter
	start := time.Now()
	r := b.sh("head -c 1G /dev/zero", asUser(user), withTimeout(60*time.Second), func(o *agentclient.RunOptions) {
		o.Stdout, o.Stderr, o.MaxOutput = &out, &errw, 16<<20
	})
	peak := procStatusKB(t, "VmHWM")
	t.Logf("flood took %v; RSS before %d kB, peak %d kB", time.Since(start), before, peak)
	if r.err != nil || r.code() != 0 {
		t.Errorf("flood: %v %+v", r.err, r.end)
	}
	if out.n+errw.n != 16<<20 || !r.end.GetTruncated() {
		t.Errorf("forwarded %d bytes, truncated=%v; want exactly 16MiB and truncated", out.n+errw.n, r.end.GetTruncated())
	}
	if grown := peak - before; grown > 200<<10 {
		t.Errorf("the test process's RSS grew by %d MiB during the flood (bound: 200 MiB)", grown>>10)
	}
}

// procStart is a host process's start time (field 22 of /proc/PID/stat).
// procStart is a process's start time, "" when it is gone. A zombie is
// gone: it holds nothing but its exit status, which its parent (the host's
// init, for an OCI container whose runtime detached) collects.
func procStart(pid int) string {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		if f := strings.Fields(s[i+1:]); len(f) > 19 && f[0] != "Z" {
			return f[19]
		}
	}
	return ""
}

// hostUID is the first uid of a host process's Uid line.
func hostUID(pid string) (int, bool) {
	b, err := os.ReadFile(filepath.Join("/proc", pid, "status"))
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Uid:"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				n, err := strconv.Atoi(f[0])
				return n, err == nil
			}
		}
	}
	return 0, false
}

func orphansDie(t *testing.T, e *hostileEnv, b *box, user string) {
	// Each sleeper double-forks away from the command, into its own
	// session, ignoring SIGTERM/HUP/INT, and ends up a child of PID 1.
	out := b.mustSh(`for i in 1 2 3; do
  (setsid bash -c 'trap "" TERM HUP INT; (exec sleep 4242 </dev/null >/dev/null 2>&1 &); exec sleep 4343' </dev/null >/dev/null 2>&1 &)
done
sleep 0.3; ps -eo ppid=,args= | grep -c '^ *1 sleep 4[23]4[23]'`, asUser(user))
	if strings.TrimSpace(out) == "0" {
		t.Errorf("no orphan was reparented to PID 1: %q", out)
	}
	// The agent runs as the sandbox's uid 65533 (inside.AgentUID); the
	// range starts 65533 below its host uid. gVisor's processes are not host
	// processes at all (the sentry runs them), so there is no range to scan.
	agentUID, ok := hostUID(strconv.Itoa(b.sb.AgentPID()))
	if !ok {
		t.Fatal("cannot read the agent's host uid")
	}
	base := agentUID - inside.AgentUID
	scanRange := b.sb.Wall() != "gvisor"
	starts := map[int]string{}
	for _, pid := range b.sb.Cgroup().Procs() {
		starts[pid] = procStart(pid)
	}
	want := 7
	if b.sb.Wall() == "microvm" {
		// The sleepers are the guest's; on the host the sandbox is QEMU
		// alone, running as the first uid of its range.
		want, base = 1, agentUID
	}
	if len(starts) < want {
		t.Errorf("the sandbox's cgroup lists %d processes, want %d (the agent and 6 sleepers, or QEMU)", len(starts), want)
	}
	b.Close()
	if err := b.sb.Destroy(); err != nil {
		t.Errorf("destroy: %v", err)
	}
	for pid, st := range starts {
		if st != "" && procStart(pid) == st {
			t.Errorf("process %d of the destroyed sandbox is still alive", pid)
		}
	}
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, _ := strconv.Atoi(d.Name())
		if uid, ok := hostUID(d.Name()); scanRange && ok && uid >= base && uid < base+65536 && procStart(pid) != "" {
			t.Errorf("host process %s still runs with uid %d of the destroyed sandbox's range", d.Name(), uid)
		}
	}
}

func pidsExhaustedAgentBusy(t *testing.T, e *hostileEnv, b *box, user string) {
	b.mustSh("head -c 8M /dev/zero > /tmp/big", asUser(user))
	var out testutil.SyncBuffer
	done := make(chan result, 1)
	go func() {
		done <- b.pyRun(`
import time
kids = []
while len(kids) < 100:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        time.sleep(4)
        os._exit(0)
    kids.append(pid)
print("holding", len(kids), "pids", flush=True)
time.sleep(3)
`, asUser(user), withTimeout(30*time.Second), func(o *agentclient.RunOptions) { o.Stdout = &out })
	}()
	if !waitFor(t, &out, "holding", 10*time.Second) {
		return
	}
	agentRoom(t, e, b)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = b.FS.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/usr/lib", Depth: 2}))
			if req, err := http.NewRequestWithContext(ctx, "GET", agentclient.BaseURL+"/files?path=/tmp/big", nil); err == nil {
				if resp, err := b.HTTP.Do(req); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
			_, _ = b.Run(ctx, agentclient.RunOptions{Cmd: "true"})
		}()
	}
	wg.Wait()
	r := <-done
	if b.agentDied() {
		t.Fatalf("the agent died while the workload held every pid: %v (%v)", r.err, b.sb.Err())
	}
	if r.err != nil || r.code() != 0 {
		t.Errorf("the pid-holding command: %v %+v", r.err, r.end)
	}
}

// agentRoom checks, while the workload holds every pid it may, that the
// agent can still have AgentThreads threads: those it has and the room
// left under its group's pids limit. The process wall's agent takes none
// ahead where the workload has a pids group of its own (cgroup v1), and
// every wall's takes them ahead where not. On the walls whose agent is a
// host process in the sandbox's group: gVisor's and the microvm's threads
// are the sentry's and the guest's.
func agentRoom(t *testing.T, e *hostileEnv, b *box) {
	t.Helper()
	cg := b.sb.Cgroup()
	if cg == nil || (e.w.name != "process" && e.w.name != "runc") {
		return
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", b.sb.AgentPID()))
	if err != nil {
		t.Errorf("the agent's threads: %v", err)
		return
	}
	read := func(file string) int {
		data, err := os.ReadFile(filepath.Join(cg.Dir("pids"), file))
		n, perr := strconv.Atoi(strings.TrimSpace(string(data)))
		if err != nil || perr != nil {
			t.Errorf("%s of the sandbox's group: %q %v %v", file, data, err, perr)
		}
		return n
	}
	limit, used := read("pids.max"), read("pids.current")
	if room := limit - used; len(tasks)+room < inside.AgentThreads {
		t.Errorf("the workload left the agent room for %d threads beside its %d (pids %d of %d): want %d in all",
			room, len(tasks), used, limit, inside.AgentThreads)
	}
}

// sentryMayDie is the outcome under gVisor of probes that exhaust the
// sandbox's memory or pids: the application's processes are threads and
// memory of gVisor's sentry, which the host's cgroup limits as one; when
// the limit is hit the host's OOM killer (or the pids limit) takes the whole
// sentry, so the sandbox may die. The probe must end within its time; the
// host and the other sandboxes must be untouched (runRow checks them).
func sentryMayDie(script string, timeout time.Duration) wallOutcome {
	return wallOutcome{
		expect: "gVisor: the whole sentry is one cgroup member, so the sandbox may die (the host's OOM killer or pids limit takes the sentry); the probe ends and the host and other sandboxes are untouched",
		mayDie: true,
		custom: func(t *testing.T, e *hostileEnv, b *box, user string) {
			done := make(chan result, 1)
			go func() { done <- b.sh(script, asUser(user), withTimeout(timeout)) }()
			select {
			case r := <-done:
				t.Logf("under gVisor the probe ended: end=%+v err=%v", r.end, r.err)
			case <-time.After(timeout + 60*time.Second):
				t.Fatal("the probe did not end")
			}
		},
	}
}
