package mcp

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/client"
)

// hostileAgent is a sandbox's agent that answers every request with
// answer (h2c, as the daemon reaches agents).
func hostileAgent(t *testing.T, answer http.HandlerFunc) *agentclient.Client {
	t.Helper()
	srv := httptest.NewUnstartedServer(answer)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok")
	t.Cleanup(c.Close)
	return c
}

// eventFrame is one enveloped message of a Start stream.
func eventFrame(ev *pb.ProcessEvent) []byte {
	b, _ := proto.Marshal(&pb.StartResponse{Event: ev})
	f := make([]byte, 5+len(b))
	binary.BigEndian.PutUint32(f[1:5], uint32(len(b)))
	copy(f[5:], b)
	return f
}

// TestChmodStderrBounded: file_write's chmod keeps what the agent says
// on stderr within a bound. The agent is inside the wall: one that
// answered the chmod with 256 MiB of stderr (and exit 1) had all of it
// kept in the daemon's heap for the error, which shows 300 bytes of it;
// the 30 s the chmod may take were many GiB at loopback speed. Now the
// daemon's heap holds far less than the stream while it passes, and the
// error still says what chmod said first.
func TestChmodStderrBounded(t *testing.T) {
	const total = 256 << 20
	chunk := eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
		Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: []byte(strings.Repeat("x", 1<<20))}}}})
	var heapAtEnd uint64
	ac := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/Start") {
			http.Error(w, "no", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/connect+proto")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}))
		_, _ = w.Write(eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
			Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: []byte("chmod: changing permissions of 'f': Operation not permitted\n")}}}}))
		for range total >> 20 {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
		w.(http.Flusher).Flush()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		heapAtEnd = ms.HeapAlloc
		_, _ = w.Write(eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true, ExitCode: 1, Status: "exit status 1"}}}))
	})
	err := (&tools{}).chmod(context.Background(), ac, "0755", "/home/user/f", "")
	if err == nil || !strings.Contains(err.Error(), "Operation not permitted") {
		t.Fatalf("chmod: %v, want chmod's own first line", err)
	}
	if heapAtEnd > total/8 {
		t.Errorf("the daemon's heap held %d MiB as the agent's %d MiB of stderr ended; want under %d MiB",
			heapAtEnd>>20, total>>20, total/8>>20)
	}
}

// silentAfterStart is an agent that starts every command and then says
// nothing more, holding its streams open until the host goes.
func silentAfterStart(w http.ResponseWriter, r *http.Request) {
	if !strings.HasSuffix(r.URL.Path, "/Start") {
		<-r.Context().Done()
		return
	}
	w.Header().Set("Content-Type", "application/connect+proto")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}))
	w.(http.Flusher).Flush()
	<-r.Context().Done()
}

// within runs f and fails the test if it has not returned after d.
func within(t *testing.T, d time.Duration, f func()) time.Duration {
	t.Helper()
	done := make(chan struct{})
	start := time.Now()
	go func() { defer close(done); f() }()
	select {
	case <-done:
		return time.Since(start)
	case <-time.After(d):
		t.Fatalf("still waiting on the agent after %v", d)
		return 0
	}
}

// TestExecBoundedByItsTimeout: exec's timeout_s is the host's bound too,
// not only the agent's. The agent is inside the wall: one that started
// the command and never ended its stream held the tool call, a daemon
// goroutine and one of the key's 16 /mcp requests for as long as the MCP
// client waited (as run_code's and Dify's runs never did). Now the call
// ends agentGrace past timeout_s with an error that says so.
func TestExecBoundedByItsTimeout(t *testing.T) {
	defer func(g time.Duration) { agentGrace = g }(agentGrace)
	agentGrace = 200 * time.Millisecond
	ac := hostileAgent(t, silentAfterStart)
	var err error
	took := within(t, 20*time.Second, func() {
		_, err = (&tools{}).runShell(context.Background(), ac, execIn{Command: "sleep 1", TimeoutS: 1},
			agentclient.RunOptions{Stdout: io.Discard, Stderr: io.Discard, TimeoutMs: 1000})
	})
	if err == nil || !strings.Contains(err.Error(), "timeout_s=1") {
		t.Errorf("exec with timeout_s=1 against an agent that never ends it: %v, want an error naming the timeout", err)
	}
	if took > 5*time.Second {
		t.Errorf("exec with timeout_s=1 took %v", took)
	}
}

// TestBackgroundStartBounded: a background exec waits for the agent to
// say the command started at most startWithin. An agent that answered
// with output and never a start event held the call for good.
func TestBackgroundStartBounded(t *testing.T) {
	defer func(d time.Duration) { startWithin = d }(startWithin)
	startWithin = 300 * time.Millisecond
	ac := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+proto")
		w.WriteHeader(http.StatusOK)
		data := eventFrame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
			Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: []byte("x")}}}})
		for r.Context().Err() == nil {
			if _, err := w.Write(data); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(10 * time.Millisecond)
		}
	})
	var err error
	within(t, 20*time.Second, func() {
		_, err = (&tools{}).startBackground(context.Background(), ac, execIn{Command: "server", TimeoutS: 60})
	})
	if err == nil {
		t.Error("a background exec whose agent never said it started: no error")
	}
}

// silentSandbox serves the daemon's API for one running sandbox, abc,
// and, as its proxy, an agent that reads each request and answers none
// (HTTP/1 and h2c on one address), and returns a client session of a
// server using them.
func silentSandbox(t *testing.T) *sdk.ClientSession {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/sandboxes/") {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"sandboxID":"abc","envdAccessToken":"tok","state":"running","templateID":"base"}`)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	s := NewServer(Config{Client: client.New(srv.URL, srv.URL, "e2b_test")})
	st, ct := sdk.NewInMemoryTransports()
	ss, err := s.Connect(context.Background(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, nil).Connect(context.Background(), ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	// First of the cleanups: a call still waiting on the agent ends.
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	return cs
}

// TestFileToolsBoundedInTime: file_read, file_write and file_list wait
// on the sandbox's agent at most fileWithin. The agent is inside the
// wall: one that never answered held each call, a daemon goroutine and
// one of the key's 16 /mcp requests for as long as the MCP client waited.
func TestFileToolsBoundedInTime(t *testing.T) {
	defer func(d time.Duration) { fileWithin = d }(fileWithin)
	fileWithin = 300 * time.Millisecond
	cs := silentSandbox(t)
	for _, c := range []struct {
		tool string
		args map[string]any
	}{
		{"file_read", map[string]any{"sandbox_id": "abc", "path": "/etc/hostname"}},
		{"file_write", map[string]any{"sandbox_id": "abc", "path": "/tmp/x", "content": "x"}},
		{"file_list", map[string]any{"sandbox_id": "abc", "path": "/tmp"}},
	} {
		var r *sdk.CallToolResult
		var err error
		within(t, 15*time.Second, func() {
			r, err = cs.CallTool(context.Background(), &sdk.CallToolParams{Name: c.tool, Arguments: c.args})
		})
		if err != nil || !r.IsError || !strings.Contains(resultText(r), "did not answer") {
			t.Errorf("%s against an agent that never answers: %v, %v; want a tool error saying so", c.tool, err, resultText(r))
		}
	}
}
