package agent

import (
	"bytes"
	"context"
	"io"
	"net"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/internal/agentclient"
)

// TestWarmUp: the agent's own request goes the whole way through its
// HTTP/2 server, Connect and Start (WarmUp checks that the answer is the
// end of a stream saying invalid_argument: the empty command), with or without a token configured,
// and leaves no process behind; the same server then serves the real
// listener, token checked.
func TestWarmUp(t *testing.T) {
	for _, token := range []string{"", fsTestToken} {
		s, _ := newAuthServer(t, func(c *Config) { c.Token = token })
		if err := s.WarmUp(); err != nil {
			t.Fatalf("token %q: %v", token, err)
		}
		s.procs.mu.Lock()
		n := len(s.procs.table)
		s.procs.mu.Unlock()
		if n != 0 {
			t.Fatalf("token %q: %d processes left after the warm-up", token, n)
		}
		sock := filepath.Join(t.TempDir(), "agent.sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- s.Serve(l) }()
		dial := func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}
		c := agentclient.New(dial, token)
		end, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "true", Cwd: "/", Stdout: io.Discard, Stderr: io.Discard})
		c.Close()
		if err != nil || end.GetExitCode() != 0 {
			t.Fatalf("token %q: a command after the warm-up: %v %v", token, err, end)
		}
		if token != "" {
			bad := agentclient.New(dial, "not-the-token")
			_, err := bad.Run(context.Background(), agentclient.RunOptions{Cmd: "true", Cwd: "/"})
			bad.Close()
			if connect.CodeOf(err) != connect.CodeUnauthenticated {
				t.Fatalf("a wrong token after the warm-up: %v, want unauthenticated", err)
			}
		}
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := <-served; err != nil {
			t.Fatalf("Serve: %v", err)
		}
	}
}

// TestWarmAnswerRefusesOthers: an answer other than invalid_argument (a refused
// token, say) is an error, not a warm-up that silently did nothing.
func TestWarmAnswerRefusesOthers(t *testing.T) {
	env := func(flags byte, body string) []byte {
		n := len(body)
		return append([]byte{flags, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, body...)
	}
	for name, tc := range map[string]struct {
		data []byte
		ok   bool
	}{
		"invalid_argument": {env(2, `{"error":{"code":"invalid_argument","message":"x"}}`), true},
		"not_found":        {env(2, `{"error":{"code":"not_found"}}`), false},
		"unauthenticated":  {env(2, `{"error":{"code":"unauthenticated"}}`), false},
		"no error":         {env(2, `{}`), false},
		"no end":           {env(0, "\x08\x01"), false},
		"truncated":        {env(2, `{"error":{"code":"invalid_argument"}}`)[:10], false},
		"message then end": {bytes.Join([][]byte{env(0, "\x08\x01"), env(2, `{"error":{"code":"invalid_argument"}}`)}, nil), true},
	} {
		if err := warmAnswer(tc.data); (err == nil) != tc.ok {
			t.Errorf("%s: warmAnswer = %v, want ok=%v", name, err, tc.ok)
		}
	}
}
