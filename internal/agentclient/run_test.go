package agentclient

import (
	"context"
	"encoding/binary"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/cagehq/cage/api/gen/process"
)

// TestRunOneStartPerStream: an agent (not trusted) answering one Start
// with 1,000 start events ends the run with an error after the second;
// one feeder of the command's input is started, not one per event
// (before: a goroutine, a 32 KiB buffer and an RPC each, all reading the
// same input at once, until the caller's context ended).
func TestRunOneStartPerStream(t *testing.T) {
	ev, _ := proto.Marshal(&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}})
	one := make([]byte, 5+len(ev))
	binary.BigEndian.PutUint32(one[1:5], uint32(len(ev)))
	copy(one[5:], ev)
	var inputs atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/Start") {
			w.Header().Set("Content-Type", "application/connect+proto")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write([]byte(strings.Repeat(string(one), 1000)))
			return
		}
		inputs.Add(1) // SendInput, CloseStdin: never answered
		<-r.Context().Done()
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}
	c := New(dial, "tok")
	defer c.Close()
	starts := 0
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := c.Run(ctx, RunOptions{Cmd: "python3", Stdin: strings.NewReader("print(1)\n"),
		Stdout: new(strings.Builder), Stderr: new(strings.Builder), OnStart: func(uint32) { starts++ }})
	if err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("1,000 start events: %v, want an error", err)
	}
	time.Sleep(200 * time.Millisecond) // a second feeder would have called by now
	if starts != 1 || inputs.Load() > 1 {
		t.Errorf("OnStart called %d times, %d input calls; want one of each at most", starts, inputs.Load())
	}
}

// TestRunOutputBoundedHere: MaxOutput is the host's bound, not only the
// agent's (which is inside the wall): an agent that sends 20,000 bytes of
// stdout and stderr to a run asking for 2,500 gets 2,500 written, stdout
// and stderr together, and the end says truncated.
func TestRunOutputBoundedHere(t *testing.T) {
	frame := func(ev *pb.ProcessEvent) []byte {
		b, _ := proto.Marshal(&pb.StartResponse{Event: ev})
		f := make([]byte, 5+len(b))
		binary.BigEndian.PutUint32(f[1:5], uint32(len(b)))
		copy(f[5:], b)
		return f
	}
	var body []byte
	body = append(body, frame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}})...)
	chunk := []byte(strings.Repeat("x", 1000))
	for i := range 20 {
		d := &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: chunk}}
		if i%2 == 1 {
			d.Output = &pb.ProcessEvent_DataEvent_Stderr{Stderr: chunk}
		}
		body = append(body, frame(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: d}})...)
	}
	body = append(body, frame(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true}}})...)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+proto")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(body)
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	c := New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok")
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var stdout, stderr strings.Builder
	end, err := c.Run(ctx, RunOptions{Cmd: "yes", Stdout: &stdout, Stderr: &stderr, MaxOutput: 2500})
	if err != nil {
		t.Fatal(err)
	}
	if n := stdout.Len() + stderr.Len(); n != 2500 || !end.GetTruncated() {
		t.Errorf("%d bytes written (stdout %d, stderr %d), truncated %v; want 2500 and truncated", n, stdout.Len(), stderr.Len(), end.GetTruncated())
	}
}
