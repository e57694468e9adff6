package cli

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
)

// TestExecSecondSignalEndsIt: the agent is inside the wall. One that
// starts the command and then never ends its stream, nor answers a
// signal, no longer holds `cage exec`: the first SIGINT is passed on, the
// second ends cage exec with 130 within seconds (before, cage exec waited
// for the agent through every SIGINT, SIGTERM and SIGHUP, the first
// signal's RPC blocking the loop that counts them).
func TestExecSecondSignalEndsIt(t *testing.T) {
	ac := neverEndingAgent(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	// The signals go once cage exec knows the command's pid: before, the
	// first gives up at once (nothing to pass it on to), cage exec stops
	// listening, and the second would kill this test's process.
	known := make(chan struct{})
	go func() {
		done <- execIn(ctx, ac, agentclient.RunOptions{Cmd: "sleep", Args: []string{"1000"}, Stdout: new(strings.Builder),
			Stderr: new(strings.Builder), OnStart: func(uint32) { close(known) }}, "never", &types.SandboxDetail{})
	}()
	select {
	case <-known:
	case <-time.After(10 * time.Second):
		t.Fatal("the command did not start")
	}
	for range 2 {
		if err := syscall.Kill(syscall.Getpid(), syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-done:
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != 130 {
			t.Fatalf("got %v, want exit 130", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("cage exec still waits for the agent 10 s after the second SIGINT")
	}
}

// countWriter counts what is written to it.
type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

// TestExecOutputBounded: `cage exec` writes at most the agent's own
// default bound of a command's output (64 MiB), counted on the host: an
// agent that sends 72 MiB and says nothing was cut gets 64 MiB written and
// the run is reported truncated (before, all of it, without end).
func TestExecOutputBounded(t *testing.T) {
	ev := func(e *pb.ProcessEvent) []byte {
		b, _ := proto.Marshal(&pb.StartResponse{Event: e})
		f := make([]byte, 5+len(b))
		binary.BigEndian.PutUint32(f[1:5], uint32(len(b)))
		copy(f[5:], b)
		return f
	}
	start := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}})
	data := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
		Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: make([]byte, 1<<20)}}}})
	end := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true}}})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/Start") {
			<-r.Context().Done()
			return
		}
		w.Header().Set("Content-Type", "application/connect+proto")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(start)
		for range 72 {
			if _, err := w.Write(data); err != nil {
				return
			}
		}
		_, _ = w.Write(end)
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	ac := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok")
	defer ac.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := &countWriter{}
	err := execIn(ctx, ac, agentclient.RunOptions{Cmd: "yes", Stdout: out, Stderr: out}, "never", &types.SandboxDetail{})
	if err != nil {
		t.Fatal(err)
	}
	if out.n != 64<<20 {
		t.Errorf("%d bytes written, want 64 MiB", out.n)
	}
}

// TestExecTerminalRestoredAtSignals: `cage exec -t` makes the caller's
// terminal raw while the command runs. A SIGTERM from outside, then a
// second, against an agent that never ends the command, ends cage exec
// with 130 and the terminal cooked again (echo, lines) (before, with a
// terminal, the signals were not caught: the first ended cage at once,
// its terminal left raw, echoing nothing).
func TestExecTerminalRestoredAtSignals(t *testing.T) {
	_, pts := openPTY(t)
	before, err := unix.IoctlGetTermios(int(pts.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if before.Lflag&(unix.ECHO|unix.ICANON) != unix.ECHO|unix.ICANON {
		t.Fatalf("a new terminal is not cooked: lflag %#x", before.Lflag)
	}
	stdin := os.Stdin
	os.Stdin = pts
	defer func() { os.Stdin = stdin }()

	ac := neverEndingAgent(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	// The signals go once cage exec knows the command's pid: before, the
	// first gives up at once (nothing to pass it on to), cage exec stops
	// listening, and the second would kill this test's process.
	known := make(chan struct{})
	go func() {
		done <- execIn(ctx, ac, agentclient.RunOptions{Cmd: "sleep", Args: []string{"1000"}, Stdout: new(strings.Builder),
			Stderr: new(strings.Builder), OnStart: func(uint32) { close(known) }}, "always", &types.SandboxDetail{})
	}()
	select {
	case <-known:
	case <-time.After(10 * time.Second):
		t.Fatal("the command did not start")
	}
	raw, err := unix.IoctlGetTermios(int(pts.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if raw.Lflag&(unix.ECHO|unix.ICANON) != 0 {
		t.Fatalf("the terminal is not raw while the command runs: lflag %#x", raw.Lflag)
	}
	for range 2 {
		if err := syscall.Kill(syscall.Getpid(), syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-done:
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != 130 {
			t.Fatalf("got %v, want exit 130", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("cage exec still waits for the agent 10 s after the second SIGTERM")
	}
	after, err := unix.IoctlGetTermios(int(pts.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag {
		t.Errorf("the terminal was left changed: lflag %#x iflag %#x oflag %#x, was %#x %#x %#x",
			after.Lflag, after.Iflag, after.Oflag, before.Lflag, before.Iflag, before.Oflag)
	}
}

// neverEndingAgent is a client of an agent that starts a command (pid 7)
// and then never ends its stream nor answers anything else.
func neverEndingAgent(t *testing.T) *agentclient.Client {
	ev, _ := proto.Marshal(&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}})
	frame := make([]byte, 5+len(ev))
	binary.BigEndian.PutUint32(frame[1:5], uint32(len(ev)))
	copy(frame[5:], ev)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/Start") {
			w.Header().Set("Content-Type", "application/connect+proto")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(frame)
			w.(http.Flusher).Flush()
		}
		<-r.Context().Done() // no end, no answer to a signal or to input
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	ac := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok")
	t.Cleanup(ac.Close)
	return ac
}
