package agentclient

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/process"
)

// hostSideAgent is hostileAgent for NewHostSide's client (the daemon's
// dashboard and /mcp), which accepts gzip-compressed answers.
func hostSideAgent(t *testing.T, answer http.HandlerFunc) *Client {
	t.Helper()
	srv := httptest.NewUnstartedServer(answer)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	c := NewHostSide(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok", http.Header{"E2b-Sandbox-Id": {"x"}})
	t.Cleanup(c.Close)
	return c
}

func gzipped(b []byte) []byte {
	var out bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&out, gzip.BestCompression)
	_, _ = zw.Write(b)
	_ = zw.Close()
	return out.Bytes()
}

// detailsJSON is a Connect error of n bytes whose details are empty
// objects: 3 bytes each on the wire, some 350 decoded.
func detailsJSON(n int, prefix string) []byte {
	var b bytes.Buffer
	b.WriteString(prefix + `{"code":"internal","message":"m","details":[{}`)
	for b.Len() < n-10 {
		b.WriteString(`,{}`)
	}
	b.WriteString(`]}`)
	if prefix != "" {
		b.WriteString(`}`)
	}
	return b.Bytes()
}

// endStream is a Connect stream's end message, flags as given.
func endStream(flags byte, msg []byte) []byte {
	f := make([]byte, 5+len(msg))
	f[0] = flags
	binary.BigEndian.PutUint32(f[1:5], uint32(len(msg)))
	copy(f[5:], msg)
	return f
}

// TestErrorAnswersBounded: what an agent says to end a call with an
// error costs the host a bounded error. Connect's client reads an error
// answer to a unary call whole, whatever WithReadMaxBytes says, and
// inflates it whole; its stream's end message is bounded by the 4 MiB of
// any message, but decodes to some 120 times that (a detail, an empty
// object of 3 bytes, some 350 bytes in memory). Before: a unary error of
// 256 MiB allocated 1.5 GiB and was the error's message, all of it; a
// 4 MiB end message 507 MiB. The dashboard asks every live page's agent
// for its processes every 2 s.
func TestErrorAnswersBounded(t *testing.T) {
	big := append(append([]byte(`{"code":"internal","message":"`), bytes.Repeat([]byte("x"), 256<<20)...), `"}`...)
	list := func(c *Client) error {
		_, err := c.Process.List(context.Background(), connect.NewRequest(&pb.ListRequest{}))
		return err
	}
	start := func(c *Client) error {
		s, err := c.Process.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "x"}}))
		if err != nil {
			return err
		}
		defer s.Close()
		for s.Receive() {
		}
		return s.Err()
	}
	for _, c := range []struct {
		name     string
		hostSide bool
		call     func(*Client) error
		header   http.Header
		status   int
		body     []byte
	}{
		{"unary error of 256 MiB", false, list, http.Header{"Content-Type": {"application/json"}}, http.StatusInternalServerError, big},
		{"unary error gzip-compressed", true, list, http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}},
			http.StatusInternalServerError, gzipped(big)},
		{"unary error of 4 MiB of details", false, list, http.Header{"Content-Type": {"application/json"}}, http.StatusInternalServerError,
			detailsJSON(4<<20, "")},
		{"end message of 4 MiB of details", false, start, http.Header{"Content-Type": {"application/connect+proto"}}, http.StatusOK,
			endStream(2, detailsJSON(4<<20-100, `{"error":`))},
		{"end message gzip-compressed", true, start, http.Header{"Content-Type": {"application/connect+proto"}, "Connect-Content-Encoding": {"gzip"}},
			http.StatusOK, endStream(3, gzipped(detailsJSON(4<<20-100, `{"error":`)))},
	} {
		t.Run(c.name, func(t *testing.T) {
			answer := func(w http.ResponseWriter, r *http.Request) {
				for k, v := range c.header {
					w.Header()[k] = v
				}
				w.WriteHeader(c.status)
				_, _ = w.Write(c.body)
			}
			var ag *Client
			if c.hostSide {
				ag = hostSideAgent(t, answer)
			} else {
				ag = hostileAgent(t, answer)
			}
			var err error
			n := allocated(func() { err = c.call(ag) })
			if err == nil {
				t.Fatal("no error")
			}
			if len(err.Error()) > maxErrorAnswer {
				t.Errorf("the error is %d bytes, want at most %d", len(err.Error()), maxErrorAnswer)
			}
			if n > 32<<20 {
				t.Errorf("the host allocated %d MiB for it, want under 32", n>>20)
			}
			t.Logf("%d MiB allocated; %.80s", n>>20, err)
		})
	}
}

// TestHonestErrorsPassUnchanged: an honest agent's errors, plain or
// compressed, a unary call's or a stream's end, reach the caller with
// their code and message (the /mcp tools tell a template without bash by
// its not_found).
func TestHonestErrorsPassUnchanged(t *testing.T) {
	unary := []byte(`{"code":"not_found","message":"/home/user/nope: no such file"}`)
	end := []byte(`{"error":{"code":"not_found","message":"/bin/bash: no such file or directory"}}`)
	for _, c := range []struct {
		name   string
		header http.Header
		status int
		body   []byte
		stream bool
		msg    string
	}{
		{"unary", http.Header{"Content-Type": {"application/json"}}, http.StatusNotFound, unary, false, "no such file"},
		{"unary gzip", http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}}, http.StatusNotFound, gzipped(unary), false, "no such file"},
		{"stream end", http.Header{"Content-Type": {"application/connect+proto"}}, http.StatusOK, endStream(2, end), true, "/bin/bash:"},
		{"stream end gzip", http.Header{"Content-Type": {"application/connect+proto"}, "Connect-Content-Encoding": {"gzip"}}, http.StatusOK,
			endStream(3, gzipped(end)), true, "/bin/bash:"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ag := hostSideAgent(t, func(w http.ResponseWriter, r *http.Request) {
				for k, v := range c.header {
					w.Header()[k] = v
				}
				w.WriteHeader(c.status)
				_, _ = w.Write(c.body)
			})
			var err error
			if c.stream {
				s, serr := ag.Process.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "x"}}))
				if serr != nil {
					t.Fatal(serr)
				}
				for s.Receive() {
				}
				err = s.Err()
				s.Close()
			} else {
				_, err = ag.Process.List(context.Background(), connect.NewRequest(&pb.ListRequest{}))
			}
			var ce *connect.Error
			if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound || !strings.Contains(ce.Message(), c.msg) {
				t.Errorf("got %v, want not_found with %q", err, c.msg)
			}
		})
	}
}
