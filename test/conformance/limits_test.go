package conformance

import (
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// Limits: each cgroup limit stops a workload that exceeds it, the end event
// says which limit did, and the sandbox keeps working afterwards.

// pyRun runs a python program (with pyPrelude) in b.
func (b *box) pyRun(code string, mods ...func(*agentclient.RunOptions)) result {
	argv := py(code)
	return b.run(append([]func(*agentclient.RunOptions){func(o *agentclient.RunOptions) {
		o.Cmd, o.Args = argv[0], argv[1:]
	}}, mods...)...)
}

func TestOOMReason(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{Memory: 64 << 20})
		r := b.pyRun(`b = bytearray(200 * 1024 * 1024); print("ALLOCATED")`, withTimeout(30*time.Second))
		if w.name == "gvisor" {
			// gVisor: the application's memory is the sentry's, which the
			// host's cgroup limits as one: the allocation never completes
			// (the host's OOM killer takes the sentry, or gVisor refuses
			// the memory), and the host is untouched. No reason is read
			// from the host's counters there.
			if strings.Contains(r.stdout, "ALLOCATED") || (r.err == nil && r.code() == 0) {
				t.Errorf("gvisor: 200MB with memory=64MiB completed: %+v %v %q", r.end, r.err, r.stdout)
			}
			return
		}
		if r.err != nil {
			t.Fatalf("the stream broke (is the agent dead?): %v", r.err)
		}
		if r.end.GetReason() != "oom" || r.code() == 0 || r.end.GetExited() || strings.Contains(r.stdout, "ALLOCATED") {
			t.Errorf(`200MB with memory=64MiB: want reason "oom", killed, got %+v stdout=%q`, r.end, r.stdout)
		}
		if r.end.GetError() == "" {
			t.Errorf("the end event of an OOM kill carries no error message")
		}
		if out := b.mustSh("echo after-oom"); out != "after-oom\n" {
			t.Errorf("follow-up: %q", out)
		}
		// A process that stays under the limit is not affected.
		r = b.pyRun(`b = bytearray(16 * 1024 * 1024); print("ok", len(b))`)
		if r.err != nil || r.code() != 0 || r.end.GetReason() != "exited" {
			t.Errorf("16MB under a 64MiB limit: %+v %v", r.end, r.err)
		}
	})
}

// TestMemoryUpToLimit: a sandbox may use most of its memory limit, in
// its processes and on its disk, and goes on: the host side of the wall
// (QEMU's cgroup on the microvm wall, which also pays for the snapshot's
// pages it touches first) leaves room for all of it.
func TestMemoryUpToLimit(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{Memory: 384 << 20, Disk: 128 << 20})
		r := b.pyRun(`
with open("/tmp/fill", "wb") as f:
    for _ in range(96):
        f.write(b"x" * (1 << 20))
b = bytearray(224 * 1024 * 1024)
for i in range(0, len(b), 4096):
    b[i] = 1
print("TOUCHED", len(b) >> 20)`, withTimeout(90*time.Second))
		if r.err != nil || r.code() != 0 || r.stdout != "TOUCHED 224\n" {
			t.Errorf("96 MiB on disk and 224 MiB touched under a 384 MiB limit: %+v %v %q %q", r.end, r.err, r.stdout, r.stderr)
		}
		if out := b.mustSh("rm /tmp/fill; echo alive"); out != "alive\n" {
			t.Errorf("after: %q", out)
		}
	})
}

func TestPidsLimit(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		if w.name == "gvisor" {
			gvisorPids(t, w)
			return
		}
		b := w.newBox(t, sandbox.Options{Pids: 32})
		// Fork sleepers until fork fails, then clean up and exit 1.
		r := b.pyRun(`
import signal, time
kids = []
failed = None
for i in range(100):
    try:
        pid = os.fork()
    except BlockingIOError as e:
        failed = e
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
print("forked", len(kids), "then", failed)
for pid in kids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
sys.exit(1 if failed else 0)
`, withTimeout(30*time.Second))
		if r.err != nil {
			t.Fatalf("the stream broke (is the agent dead?): %v", r.err)
		}
		if r.code() != 1 || r.end.GetReason() != "pids_limit" || !strings.Contains(r.stdout, "then [Errno 11]") {
			t.Errorf(`forking 100 with pids=32: want exit 1, reason "pids_limit", got %+v stdout=%q stderr=%q`, r.end, r.stdout, clip(r.stderr))
		}
		if f := strings.Fields(r.stdout); len(f) > 1 {
			if n, _ := strconv.Atoi(f[1]); n >= 32 || n == 0 {
				t.Errorf("forked %d processes under pids=32", n)
			}
		}
		// Once the processes are gone the sandbox runs commands again, and
		// a command that does not hit the limit ends as "exited".
		r = b.sh("echo after; exit 3")
		if r.err != nil || r.stdout != "after\n" || r.code() != 3 || r.end.GetReason() != "exited" {
			t.Errorf("after the limit: %+v %v %q", r.end, r.err, r.stdout)
		}
	})
}

func TestCPULimit(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{CPUs: 0.2})
		// Busy-loop for 1s of wall time and report the CPU time it got.
		const spin = `
import time
t0 = time.monotonic(); c0 = os.times()
while time.monotonic() - t0 < 1.0:
    pass
c1 = os.times()
print("%.3f" % ((c1.user - c0.user) + (c1.system - c0.system)))
`
		before, err := b.sb.Cgroup().Usage()
		if err != nil {
			t.Fatalf("the sandbox's cgroup: %v", err)
		}
		start := time.Now()
		r := b.pyRun(spin, withTimeout(30*time.Second))
		elapsed := time.Since(start)
		after, err := b.sb.Cgroup().Usage()
		if err != nil {
			t.Fatalf("the sandbox's cgroup: %v", err)
		}
		if r.err != nil || r.code() != 0 {
			t.Fatalf("spin: %v %+v %q", r.err, r.end, r.stderr)
		}
		cpu, err := strconv.ParseFloat(strings.TrimSpace(r.stdout), 64)
		if err != nil {
			t.Fatalf("spin output %q", r.stdout)
		}
		// The host's count: everything the sandbox's group ran (the agent,
		// python's start, the loop; gVisor's sentry, QEMU's vCPU) while the
		// command ran, as a share of the time it took. 0.2 CPUs is 0.2 of
		// it; the bound leaves room for the quota's period granularity.
		host := float64(after.CPUNanos-before.CPUNanos) / 1e9
		share := host / elapsed.Seconds()
		t.Logf("with cpus=0.2: the loop saw %.3fs of CPU in 1s; the host counted %.3fs in %.2fs (%.2f CPUs)",
			cpu, host, elapsed.Seconds(), share)
		if share > 0.35 {
			t.Errorf("with cpus=0.2 the sandbox's group used %.2f CPUs (%.3fs in %.2fs)", share, host, elapsed.Seconds())
		}
		// Inside, a throttled task's time is the kernel's to count on
		// process, runc and microvm (a VM's guest kernel does not see the
		// host throttle its vCPU, but TCG's and KVM's ticks stop with it).
		// gVisor's sentry counts a task's time by its own clock, throttled
		// spells included, so only the host's count speaks for it.
		if w.name != "gvisor" && cpu > 0.5 {
			t.Errorf("with cpus=0.2 a 1s busy loop got %.3fs of CPU, want at most ~0.5s", cpu)
		}
	})
}

// gvisorPids: under gVisor the application's processes are tasks of the
// sentry; the host's pids limit counts the sentry's threads, so a fork loop
// either meets it (and may take the sentry down) or stops at gVisor's own
// limit. Expected: the loop ends, never reaching 200 live processes past
// a limit of 32, and the host is untouched.
func gvisorPids(t *testing.T, w wall) {
	b := w.newBox(t, sandbox.Options{Pids: 32})
	r := b.pyRun(`
import time
n = 0
for i in range(200):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    except OSError:
        break
print("forked", n)
`, withTimeout(20*time.Second))
	if r.err == nil && strings.Contains(r.stdout, "forked 200") {
		t.Errorf("gvisor: 200 processes under pids=32: %q", r.stdout)
	}
	if out, err := exec.Command("/bin/sh", "-c", "echo forked").Output(); err != nil || string(out) != "forked\n" {
		t.Errorf("the host cannot fork: %v", err)
	}
}

// TestOpenFilesLimit: every wall gives commands the same open files limit,
// soft and hard alike, whatever soft limit the host's cage runs with:
// 65536, or the host's hard limit where that is lower (a microVM's guest
// has a kernel of its own: 65536 or half its fs.file-max, so that one
// process meets EMFILE before the guest runs out: see TestHostileWorkloads'
// fd_exhaustion).
func TestOpenFilesLimit(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		t.Fatal(err)
	}
	forEachWall(t, func(t *testing.T, w wall) {
		want := min(rl.Max, 65536)
		b := w.newBox(t, sandbox.Options{})
		if w.name == "microvm" {
			fileMax, err := strconv.ParseUint(strings.TrimSpace(b.mustSh("cat /proc/sys/fs/file-max")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			want = min(65536, max(fileMax/2, 1024))
		}
		for _, user := range []string{"user", "root"} {
			if out := b.mustSh("ulimit -Sn; ulimit -Hn", asUser(user)); out != fmt.Sprintf("%d\n%d\n", want, want) {
				t.Errorf("as %s: open files soft and hard %q, want %d both", user, out, want)
			}
		}
	})
}
