package microvm

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/channel"
)

// frameLog records the yamux frame types that cross a connection (each
// write of yamux's is one frame's header, or a body).
type frameLog struct {
	net.Conn
	mu    sync.Mutex
	pings int
}

func (f *frameLog) Write(b []byte) (int, error) {
	// A header: version 0, type, flags, stream id, length. A ping is type 2
	// on stream 0 with SYN (a request) or ACK (an answer).
	if len(b) == 12 && b[0] == 0 && b[1] == 2 {
		f.mu.Lock()
		f.pings++
		f.mu.Unlock()
	}
	return f.Conn.Write(b)
}

func (f *frameLog) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pings
}

// TestNudge: the host pings the guest while a stream is open, about once
// per nudgeEvery, and not at all while none is (an idle or pooled sandbox
// costs nothing); it stops when the session ends.
func TestNudge(t *testing.T) {
	hostEnd, guestEnd := net.Pipe()
	host := &frameLog{Conn: hostEnd}
	guest, err := yamux.Server(guestEnd, channel.SessionConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer guest.Close()
	sess, err := channel.Client(host)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			s, err := guest.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, s) }()
		}
	}()
	done := make(chan struct{})
	var stalls atomic.Int32
	go func() { nudge(sess, func(time.Duration, int) { stalls.Add(1) }); close(done) }()

	time.Sleep(3 * nudgeEvery)
	if n := host.count(); n != 0 {
		t.Errorf("%d pings with no stream open, want none", n)
	}
	st, err := sess.Open()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * nudgeEvery)
	for host.count() < 2 && time.Now().Before(deadline) {
		time.Sleep(nudgeEvery / 10)
	}
	if n := host.count(); n < 2 {
		t.Errorf("%d pings in %v with a stream open, want at least 2", n, 20*nudgeEvery)
	}
	if n := stalls.Load(); n != 0 {
		t.Errorf("a guest that answers every ping was reported stalled %d times", n)
	}
	st.Close()
	sess.Close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("nudge goes on after the session ended")
	}
}

// TestNudgeStall: a guest that answers no ping while a stream is open is
// reported once (not once per ping) after stallAfter, and a report is what
// the hang leaves: the session goes on.
func TestNudgeStall(t *testing.T) {
	defer func(d time.Duration) { stallAfter = d }(stallAfter)
	stallAfter = 300 * time.Millisecond
	hostEnd, guestEnd := net.Pipe()
	go func() { _, _ = io.Copy(io.Discard, guestEnd) }() // a guest that reads and never answers
	sess, err := channel.Client(hostEnd)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	reports := make(chan time.Duration, 16)
	go nudge(sess, func(d time.Duration, streams int) {
		if streams != 1 {
			t.Errorf("a stall reported with %d streams open, want the 1 open", streams)
		}
		reports <- d
	})
	time.Sleep(2 * nudgeEvery)
	if n := len(reports); n != 0 {
		t.Fatalf("%d stall reports with no stream open (no ping sent), want none", n)
	}
	if _, err := sess.Open(); err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-reports:
		if d != stallAfter {
			t.Errorf("reported a stall of %v, want %v", d, stallAfter)
		}
	case <-time.After(10 * nudgeEvery):
		t.Fatalf("no stall report in %v of unanswered pings", 10*nudgeEvery)
	}
	time.Sleep(4 * nudgeEvery) // more pings, all unanswered
	if n := len(reports); n != 0 {
		t.Errorf("%d more reports of the same stall, want one in all", n)
	}
	if sess.IsClosed() {
		t.Error("the session ended over unanswered pings")
	}
}

// slowConn hands on what it reads d late: a guest that answers every
// ping late.
type slowConn struct {
	net.Conn
	d time.Duration
}

func (c slowConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	time.Sleep(c.d)
	return n, err
}

// TestNudgeStallReportsBounded: a guest that answers each ping just after
// stallAfter is reported at most once every reportEvery (it made a report,
// a QMP session and a log line, every few seconds; found by review,
// 2026-12-03), and a report keeps a bounded tail of what the guest wrote.
func TestNudgeStallReportsBounded(t *testing.T) {
	defer func(d, e time.Duration) { stallAfter, reportEvery = d, e }(stallAfter, reportEvery)
	stallAfter, reportEvery = 300*time.Millisecond, 5*time.Second
	// A socket pair: the host's writes do not wait for the slow reader.
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	hostEnd, err := net.FileConn(os.NewFile(uintptr(fds[0]), "host"))
	if err != nil {
		t.Fatal(err)
	}
	guestEnd, err := net.FileConn(os.NewFile(uintptr(fds[1]), "guest"))
	if err != nil {
		t.Fatal(err)
	}
	guest, err := yamux.Server(slowConn{guestEnd, stallAfter + 100*time.Millisecond}, channel.SessionConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer guest.Close()
	go func() {
		for {
			s, err := guest.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, s) }()
		}
	}()
	sess, err := channel.Client(hostEnd)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	var reports atomic.Int32
	go nudge(sess, func(time.Duration, int) { reports.Add(1) })
	if _, err := sess.Open(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(8 * time.Second)
	if n := reports.Load(); n < 1 || n > 2 {
		t.Errorf("%d stall reports in 8 s of late answers, want 1 or 2 (one every %v)", n, reportEvery)
	}
	if got := clip(strings.Repeat("\x01", 1<<16), maxReportConsole); len(got) > maxReportConsole+len("…") {
		t.Errorf("a console line of 64 KiB kept %d bytes", len(got))
	}
}

// TestStallReportVM: a real guest that stops answering while a command's
// stream is open (its QEMU stopped with SIGSTOP) is reported in the
// wall's log with QEMU's view of the virtio queues, once QEMU answers
// again; the sandbox then serves as before.
func TestStallReportVM(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	defer func(d time.Duration) { stallAfter = d }(stallAfter)
	stallAfter = 2 * time.Second
	var log testutil.SyncBuffer
	// Its run directory is its own: the image and the snapshot are made
	// first (a minute or more on a loaded CI host).
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "stall0000000000000001", Template: tmpl, DiskBytes: 16 << 20, Token: "t"},
		RunDir: testutil.RunDir(t), AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1,
		Log: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	started := make(chan struct{})
	go func() {
		_, _ = c.Run(ctx, agentclient.RunOptions{Cmd: "sleep", Args: []string{"60"}, Stdout: io.Discard, Stderr: io.Discard,
			OnStart: func(uint32) { close(started) }})
	}()
	select {
	case <-started:
	case <-time.After(60 * time.Second):
		t.Fatal("sleep did not start")
	}
	pid := sb.v.Pid()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(stallAfter + 3*nudgeEvery)
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(log.String(), "the guest has not answered") && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	got := log.String()
	if !strings.Contains(got, "the guest has not answered the host's ping") || !strings.Contains(got, "virtio-serial: q0 avail") || !strings.Contains(got, "streams=1") {
		t.Fatalf("no stall report with the virtio queues in the log:\n%s", got)
	}
	if n := strings.Count(got, "the guest has not answered"); n != 1 {
		t.Errorf("%d reports of one stall, want 1:\n%s", n, got)
	}
	t.Logf("the report: %s", got)
	var out bytes.Buffer
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"still here"}, Stdout: &out, Stderr: io.Discard})
	if err != nil || end.GetExitCode() != 0 || out.String() != "still here\n" {
		t.Errorf("after the stall: %q, %v", out.String(), err)
	}
}
