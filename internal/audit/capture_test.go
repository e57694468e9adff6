package audit

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"

	pb "github.com/cagehq/cage/api/gen/process"
)

// connectBody is a Connect request (protobuf, one envelope) for process
// pid, padded with pad bytes of a field no one knows.
func connectBody(pid uint32, pad int) []byte {
	sel := protowire.AppendTag(nil, 1, protowire.VarintType)
	sel = protowire.AppendVarint(sel, uint64(pid))
	m := protowire.AppendTag(nil, 1, protowire.BytesType)
	m = protowire.AppendBytes(m, sel)
	if pad > 0 {
		m = protowire.AppendTag(m, 99, protowire.BytesType)
		m = protowire.AppendBytes(m, bytes.Repeat([]byte("A"), pad))
	}
	env := make([]byte, 5, 5+len(m))
	binary.BigEndian.PutUint32(env[1:], uint32(len(m)))
	return append(env, m...)
}

// TestCaptureLetGoOnceAnswered: what the trail keeps of a request to
// decode its entry is let go once the agent answers; a stream (Connect to
// a process, a Start) may stay open for hours, and a client that padded
// each of its requests to a MiB held a MiB of the daemon's memory per
// stream (a tenant, 1024 streams a sandbox: found by review, 2026-12-03).
// The entry still has what it needs.
func TestCaptureLetGoOnceAnswered(t *testing.T) {
	tr := startTrail(t, Limits{})
	for _, path := range []string{"/process.Process/Connect", "/process.Process/Start"} {
		body := connectBody(42, 1<<20-64)
		r, _ := http.NewRequest(http.MethodPost, "http://agent"+path, bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/connect+proto")
		response, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
		c, ok := r.Body.(*capture)
		if !ok {
			t.Fatalf("%s: the request's body is not captured", path)
		}
		if _, err := io.Copy(io.Discard, r.Body); err != nil { // the transport sends it
			t.Fatal(err)
		}
		if b, _, _ := c.bytes(); len(b) == 0 && path == "/process.Process/Connect" {
			t.Fatalf("%s: nothing captured before the answer", path)
		}
		pr, pw := io.Pipe() // the stream stays open
		response(&http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/connect+proto"}}, Body: pr})
		if b, _, _ := c.bytes(); b != nil {
			t.Errorf("%s: %d bytes of the request kept while its stream is open", path, len(b))
		}
		pw.Close()
		done()
	}
}

// connectAgent answers Connect as an agent does: the start event, then
// the end.
type connectAgent struct{ fakeAgent }

func (connectAgent) Connect(_ context.Context, req *connect.Request[pb.ConnectRequest], s *connect.ServerStream[pb.ConnectResponse]) error {
	pid := req.Msg.GetProcess().GetPid()
	if err := s.Send(&pb.ConnectResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: pid}}}}); err != nil {
		return err
	}
	return s.Send(&pb.ConnectResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{ExitCode: 3, Exited: true, Status: "exit status 3"}}}})
}

// TestEnvdConnectEnd: a process's end seen on a Connect stream is
// recorded for the process the Connect named.
func TestEnvdConnectEnd(t *testing.T) {
	tr, url := setupWith(t, connectAgent{})
	req, _ := http.NewRequest(http.MethodPost, url+"/process.Process/Connect", bytes.NewReader(connectBody(77, 4096)))
	req.Header.Set("Content-Type", "application/connect+proto")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	es := entriesOf(t, tr, KindProcessEnd, 1)
	if len(es) != 1 || es[0]["pid"] != float64(77) || es[0]["exit_code"] != float64(3) {
		t.Fatalf("the end of a Connect stream: %v", es)
	}
}
