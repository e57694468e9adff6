package spawner

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/testutil"
)

func newClient(t *testing.T) *Client {
	t.Helper()
	testutil.RequireRoot(t)
	c := New(filepath.Join(testutil.Binaries(t), "cage-agent"), nil)
	t.Cleanup(c.Close)
	return c
}

// run spawns sh -c script with stdout and stderr on a pipe and returns the
// child and what it wrote (read to the end).
func run(t *testing.T, c *Client, req Request, script string) (*Child, string) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	req.Path, req.Argv, req.Dir = "/bin/sh", []string{"sh", "-c", script}, "/"
	req.Env = []string{"PATH=/usr/bin:/bin"}
	child, err := c.Spawn(req, []uintptr{devnull.Fd(), w.Fd(), w.Fd()})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(r)
	return child, string(out)
}

func end(t *testing.T, ch *Child) syscall.WaitStatus {
	t.Helper()
	select {
	case ws, ok := <-ch.Status:
		if !ok {
			t.Fatal("the end of the child was not reported")
		}
		return ws
	case <-time.After(10 * time.Second):
		t.Fatal("no end reported in 10 s")
	}
	return 0
}

func TestSpawnReportsOutputAndEnd(t *testing.T) {
	c := newClient(t)
	ch, out := run(t, c, Request{}, "echo hello; exit 3")
	defer unix.Close(ch.Pidfd)
	if out != "hello\n" {
		t.Fatalf("output %q, want hello", out)
	}
	hostproc.WaitPidfd(ch.Pidfd) // the pidfd is the child's
	if ws := end(t, ch); !ws.Exited() || ws.ExitStatus() != 3 {
		t.Fatalf("status %v, want exit 3", ws)
	}
}

// A child gets exactly the descriptors of its request: not the spawner's
// socket, not another request's descriptors.
func TestSpawnChildHasOnlyItsFiles(t *testing.T) {
	c := newClient(t)
	// Another child holding a pipe open meanwhile.
	r, w, _ := os.Pipe()
	defer r.Close()
	other, err := c.Spawn(Request{Path: "/bin/sleep", Argv: []string{"sleep", "30"}, Dir: "/"}, []uintptr{r.Fd(), w.Fd(), w.Fd()})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = unix.PidfdSendSignal(other.Pidfd, unix.SIGKILL, nil, 0)
		unix.Close(other.Pidfd)
	}()
	// ls itself, exec'd by the shell, lists its own descriptors: all but
	// the directory it reads were inherited.
	ch, out := run(t, c, Request{}, `exec ls -l /proc/self/fd`)
	defer unix.Close(ch.Pidfd)
	var fds []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 3 || f[len(f)-2] != "->" || strings.HasPrefix(f[len(f)-1], "/proc/") {
			continue
		}
		fds = append(fds, f[len(f)-3])
	}
	sort.Strings(fds)
	if strings.Join(fds, ",") != "0,1,2" {
		t.Fatalf("the child holds descriptors %v, want 0,1,2 only:\n%s", fds, out)
	}
	if strings.Contains(out, "socket") {
		t.Fatalf("the child holds a socket:\n%s", out)
	}
}

func TestSpawnErrors(t *testing.T) {
	c := newClient(t)
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	files := []uintptr{devnull.Fd(), devnull.Fd(), devnull.Fd()}
	_, err := c.Spawn(Request{Path: "/nonexistent/agent", Argv: []string{"agent"}, Dir: "/"}, files)
	if !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("a missing program: %v, want ENOENT", err)
	}
	_, err = c.Spawn(Request{Path: "/bin/true", Argv: []string{"true"}, Dir: "/", Cgroup: "../escape"}, files)
	if err == nil || !strings.Contains(err.Error(), "bad cgroup name") {
		t.Fatalf("a cgroup name with a slash: %v, want refused", err)
	}
	_, err = c.Spawn(Request{Path: "/bin/true", Argv: []string{"true"}, Dir: "/"}, files[:1])
	if err == nil {
		t.Fatal("a request with one descriptor was served")
	}
	// The spawner serves on after refusals.
	ch, out := run(t, c, Request{}, "echo still")
	unix.Close(ch.Pidfd)
	if out != "still\n" {
		t.Fatalf("after refusals: %q", out)
	}
}

// The child is born in its namespaces and its cgroup, with the priority
// asked for.
func TestSpawnNamespacesCgroupNice(t *testing.T) {
	c := newClient(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	// Under cage's own parent group, which the host keeps anyway: a parent
	// of the test's own would stay behind on the host, empty.
	m, err := cgroups.Detect("cage")
	if err != nil {
		t.Skip(err)
	}
	name := fmt.Sprintf("spawner-test-%d", os.Getpid())
	cg, err := m.Create(name, cgroups.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	maps := []syscall.SysProcIDMap{{ContainerID: 0, HostID: 200000, Size: 65536}}
	ch, out := run(t, c, Request{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID | syscall.CLONE_NEWNS,
		UIDMaps: maps, GIDMaps: maps, Setgroups: true, Setsid: true,
		CgroupParent: "cage", Cgroup: name, Nice: 7},
		"echo $$; id -u; cat /proc/self/cgroup; cut -d' ' -f19 /proc/self/stat")
	defer unix.Close(ch.Pidfd)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 4 || lines[0] != "1" || lines[1] != "0" {
		t.Fatalf("want pid 1 and uid 0 in the new namespaces, got:\n%s", out)
	}
	if !strings.Contains(out, "/cage/"+name) {
		t.Fatalf("not born in its cgroup:\n%s", out)
	}
	if lines[len(lines)-1] != "7" {
		t.Fatalf("nice %s, want 7", lines[len(lines)-1])
	}
	end(t, ch)
	if err := cg.Destroy(); err != nil {
		t.Fatal(err)
	}
}

// A spawner that died is started again at the next request; a child it
// had started lives on, its pidfd still watches it, and its end is
// reported as unknown.
func TestSpawnerStartedAgain(t *testing.T) {
	c := newClient(t)
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	files := []uintptr{devnull.Fd(), devnull.Fd(), devnull.Fd()}
	long, err := c.Spawn(Request{Path: "/bin/sleep", Argv: []string{"sleep", "30"}, Dir: "/"}, files)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(long.Pidfd)
	c.mu.Lock()
	first := c.conn.proc
	c.mu.Unlock()
	if err := first.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case _, ok := <-long.Status:
		if ok {
			t.Fatal("an end was reported for a child that is still running")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the spawner's death was not noticed")
	}
	if err := unix.Kill(long.PID, 0); err != nil {
		t.Fatalf("the child died with the spawner: %v", err)
	}
	ch, out := run(t, c, Request{}, "echo again")
	unix.Close(ch.Pidfd)
	if out != "again\n" {
		t.Fatalf("after a restart: %q", out)
	}
	c.mu.Lock()
	second := c.conn.proc
	c.mu.Unlock()
	if second.Pid == first.Pid {
		t.Fatal("the spawner was not started again")
	}
	if err := unix.PidfdSendSignal(long.Pidfd, unix.SIGKILL, nil, 0); err != nil {
		t.Fatal(err)
	}
	hostproc.WaitPidfd(long.Pidfd)
}

// The spawner exits when the daemon's end closes.
func TestSpawnerEndsWithItsDaemon(t *testing.T) {
	c := newClient(t)
	ch, _ := run(t, c, Request{}, "true")
	unix.Close(ch.Pidfd)
	c.mu.Lock()
	pid := c.conn.proc.Pid
	c.mu.Unlock()
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidfd)
	c.Close()
	done := make(chan struct{})
	go func() { hostproc.WaitPidfd(pidfd); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the spawner outlived its daemon's socket")
	}
}

// Children waiting to end hold no spawner thread each, and every end is
// reported with its own status.
func TestSpawnerReapsWithoutAThreadPerChild(t *testing.T) {
	c := newClient(t)
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	files := []uintptr{devnull.Fd(), devnull.Fd(), devnull.Fd()}
	const n = 100
	var children []*Child
	for i := range n {
		ch, err := c.Spawn(Request{Path: "/bin/sh", Argv: []string{"sh", "-c", fmt.Sprintf("sleep 1; exit %d", i%50)}, Dir: "/"}, files)
		if err != nil {
			t.Fatal(err)
		}
		children = append(children, ch)
	}
	c.mu.Lock()
	pid := c.conn.proc.Pid
	c.mu.Unlock()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			if th, _ := strconv.Atoi(strings.TrimSpace(v)); th > 30 {
				t.Errorf("the spawner holds %d threads for %d running children", th, n)
			}
		}
	}
	for i, ch := range children {
		if ws := end(t, ch); !ws.Exited() || ws.ExitStatus() != i%50 {
			t.Errorf("child %d: status %v, want exit %d", i, ws, i%50)
		}
		unix.Close(ch.Pidfd)
	}
}

// One socket's messages are read into the same buffers, one after the
// other, each decoded whole: a long message followed by a short one
// leaves nothing of the first in the second, and descriptors still come.
func TestReceiverReusesBuffers(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	long := Request{ID: 1, Path: "/" + strings.Repeat("x", 4000), Argv: []string{"a", "b"}}
	short := Request{ID: 2, Path: "/y"}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	if err := send(fds[0], &long, nil); err != nil {
		t.Fatal(err)
	}
	if err := send(fds[0], &short, []int{int(devnull.Fd())}); err != nil {
		t.Fatal(err)
	}
	rc := newReceiver()
	var got1, got2 Request
	if files, err := rc.recv(fds[1], &got1); err != nil || len(files) != 0 {
		t.Fatalf("first: files %v, err %v", files, err)
	}
	files, err := rc.recv(fds[1], &got2)
	if err != nil || len(files) != 1 {
		t.Fatalf("second: files %v, err %v", files, err)
	}
	closeAll(files)
	if got1.Path != long.Path || len(got1.Argv) != 2 || got2.ID != 2 || got2.Path != "/y" || got2.Argv != nil {
		t.Errorf("decoded %+v and %+v", got1, got2)
	}
	// What the first decoded is its own, not the reused buffer's.
	if got1.Path != long.Path {
		t.Error("the first message changed when the second was read")
	}
}

// BenchmarkRecv reads one request at a time from a socket, as the spawner
// and its client do for each sandbox.
func BenchmarkRecv(b *testing.B) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	req := Request{ID: 7, Path: "/usr/bin/cage-agent", Argv: []string{"cage-agent", "init"}, Env: []string{"PATH=/usr/bin", "GOMAXPROCS=1"}}
	rc := newReceiver()
	b.ReportAllocs()
	for b.Loop() {
		if err := send(fds[0], &req, nil); err != nil {
			b.Fatal(err)
		}
		var got Request
		if _, err := rc.recv(fds[1], &got); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSpawnerDeadTouchesNoReusedNumber: once the spawner died, its
// connection's descriptor is closed, and its number may be another
// file's; neither Close nor a Spawn may act on that number. Before, Close
// shut down whatever socket had taken it (a client's connection, an
// agent's, QMP's), and a Spawn racing the death could send its request,
// with the host descriptors it carries, on it. Here a socket pair is put
// on the number as soon as the reader has closed it; then the client is
// closed and asked to spawn on the dead connection. Expected: the pair
// still carries a message both ways, and the spawn fails.
func TestSpawnerDeadTouchesNoReusedNumber(t *testing.T) {
	c := newClient(t)
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	files := []uintptr{devnull.Fd(), devnull.Fd(), devnull.Fd()}
	ch, err := c.Spawn(Request{Path: "/bin/true", Argv: []string{"true"}, Dir: "/"}, files)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.Pidfd)
	c.mu.Lock()
	cn := c.conn
	c.mu.Unlock()
	number := cn.fd
	if err := cn.proc.Kill(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, err := unix.FcntlInt(uintptr(number), unix.F_GETFD, 0); err == unix.EBADF {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dead spawner's descriptor was not closed in 10 s")
		}
	}
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	// The lowest free numbers are taken, so either end may already be
	// the number (the other end then lower, when a lower number was
	// free); here is the end on the number and peer the other one.
	here, peer := pair[0], pair[1]
	if peer == number {
		here, peer = peer, here
	}
	defer unix.Close(peer)
	if here != number {
		if err := unix.Dup3(here, number, unix.O_CLOEXEC); err != nil {
			t.Fatal(err)
		}
		unix.Close(here)
	}
	defer unix.Close(number)

	if _, err := cn.spawn(Request{Path: "/bin/true", Argv: []string{"true"}, Dir: "/"}, files); err == nil {
		t.Error("a spawn on the dead connection succeeded")
	}
	c.Close()

	// Whatever was sent on the number arrives at the pair's other end.
	buf := make([]byte, 64<<10)
	switch n, _, _, _, err := unix.Recvmsg(peer, buf, make([]byte, 256), unix.MSG_DONTWAIT); {
	case err == nil && n == 0:
		t.Error("the socket that took the dead spawner's number was shut down")
	case err != unix.EAGAIN:
		t.Errorf("the socket that took the dead spawner's number was sent %d bytes (%v): %.80q", n, err, buf[:max(n, 0)])
	}
	for _, e := range [][2]int{{number, peer}, {peer, number}} {
		if _, err := unix.Write(e[0], []byte("x")); err != nil {
			t.Fatalf("the socket that took the dead spawner's number was shut down: %v", err)
		}
		if n, err := unix.Read(e[1], buf); err != nil || n != 1 {
			t.Fatalf("the socket that took the dead spawner's number: read %d, %v", n, err)
		}
	}
}
