package sandbox

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/gen/process/processconnect"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// floodAgent answers a Start with 64 MiB of stdout, then exit 1: an
// image's /bin/sh (or its agent) that says more than anyone reads.
type floodAgent struct {
	processconnect.UnimplementedProcessHandler
}

func (floodAgent) Start(_ context.Context, _ *connect.Request[pb.StartRequest], s *connect.ServerStream[pb.StartResponse]) error {
	ev := func(e *pb.ProcessEvent) error { return s.Send(&pb.StartResponse{Event: e}) }
	if err := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 2}}}); err != nil {
		return err
	}
	chunk := bytes.Repeat([]byte("x"), 1<<20)
	for range 64 {
		if err := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
			Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: chunk}}}}); err != nil {
			return err
		}
	}
	return ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{ExitCode: 1, Exited: true, Reason: "exited"}}})
}

// dialSandbox is a sandbox whose agent is at addr.
type dialSandbox struct {
	wall.Sandbox
	addr string
}

func (d dialSandbox) Token() string { return "tok" }
func (d dialSandbox) Dial(ctx context.Context) (net.Conn, error) {
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", d.addr)
}

// Attack: an image whose /bin/sh answers the start command with output
// without end (64 MiB here) and fails. Expected: the create fails naming
// the start command, with at most maxStartOutput bytes of that output;
// before, all of it was kept in the daemon's memory and put in the error.
func TestStartCommandOutputBounded(t *testing.T) {
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(floodAgent{}))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	defer srv.Close()
	tmpl := &template.Template{Name: "flood", Image: &template.Image{Info: &imgstore.Template{
		Config: imgstore.Config{Labels: map[string]string{LabelStart: "serve"}}}}}
	err := startCommand(dialSandbox{addr: strings.TrimPrefix(srv.URL, "http://")}, tmpl)
	if err == nil || !strings.Contains(err.Error(), "start command could not be started (exit 1)") {
		t.Fatalf("startCommand = %.200v; want the start command's failure", err)
	}
	if n := len(err.Error()); n > maxStartOutput+200 {
		t.Errorf("the error holds %d bytes of the command's output; want at most %d", n, maxStartOutput)
	}
}
