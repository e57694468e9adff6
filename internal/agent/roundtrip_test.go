package agent

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/cagehq/cage/internal/agentclient"
)

// BenchmarkStartTrue is the agent's share of a round trip: Start of
// `true` -> its end event, over HTTP/2 on a unix socket, with the client
// cage uses (agentclient), both in this process.
func BenchmarkStartTrue(b *testing.B) {
	c := startLocalAgent(b)
	ctx := context.Background()
	run := func() {
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
		if err != nil || end.GetExitCode() != 0 {
			b.Fatal(err, end)
		}
	}
	run()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		run()
	}
}

// startLocalAgent serves an agent in this process on a unix socket (the
// test's own user its sandbox user) and returns cage's client of it.
func startLocalAgent(tb testing.TB) *agentclient.Client {
	tb.Helper()
	dir := tb.TempDir()
	passwd := filepath.Join(dir, "passwd")
	home := filepath.Join(dir, "home")
	if err := os.Mkdir(home, 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(passwd, []byte(fmt.Sprintf("user:x:%d:%d::%s:/bin/sh\n", os.Getuid(), os.Getgid(), home)), 0o644); err != nil {
		tb.Fatal(err)
	}
	s, err := New(Config{Root: dir, Passwd: passwd, Group: passwd, Token: "t"})
	if err != nil {
		tb.Fatal(err)
	}
	sock := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatal(err)
	}
	go s.Serve(l)
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, "t")
	tb.Cleanup(func() {
		c.Close()
		s.Shutdown(context.Background())
	})
	return c
}
