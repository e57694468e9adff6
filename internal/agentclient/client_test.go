package agentclient

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	pb "github.com/cagehq/cage/api/gen/process"
)

// TestCompressionAsked: a client of a local agent does not ask for gzip
// (it saves nothing over a socket and costs a fresh agent a compressor);
// one through the daemon's proxy, which may be across a network, does.
func TestCompressionAsked(t *testing.T) {
	got := make(chan http.Header, 2)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		http.Error(w, "no", http.StatusTeapot)
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true) // the client speaks h2c
	srv.Start()
	defer srv.Close()
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}
	for _, c := range []struct {
		name   string
		client *Client
		want   bool
	}{
		{"local", New(dial, "tok"), false},
		{"proxy", NewWithHeaders(dial, "tok", http.Header{"E2b-Sandbox-Id": {"x"}}), true},
	} {
		// A unary RPC (Accept-Encoding) and a server stream
		// (Connect-Accept-Encoding).
		_, _ = c.client.FS.Stat(context.Background(), connect.NewRequest(&fspb.StatRequest{Path: "/"}))
		unary := <-got
		if stream, err := c.client.Process.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "true"}})); err == nil {
			stream.Close()
		}
		streamed := <-got
		c.client.Close()
		if has := strings.Contains(unary.Get("Accept-Encoding"), "gzip"); has != c.want {
			t.Errorf("%s client, unary: Accept-Encoding %q, want gzip: %v", c.name, unary.Get("Accept-Encoding"), c.want)
		}
		if has := strings.Contains(streamed.Get("Connect-Accept-Encoding"), "gzip"); has != c.want {
			t.Errorf("%s client, stream: Connect-Accept-Encoding %q, want gzip: %v", c.name, streamed.Get("Connect-Accept-Encoding"), c.want)
		}
	}
}
