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
	dir := b.TempDir()
	passwd := filepath.Join(dir, "passwd")
	home := filepath.Join(dir, "home")
	_ = os.Mkdir(home, 0o755)
	if err := os.WriteFile(passwd, []byte(fmt.Sprintf("user:x:%d:%d::%s:/bin/sh\n", os.Getuid(), os.Getgid(), home)), 0o644); err != nil {
		b.Fatal(err)
	}
	s, err := New(Config{Root: dir, Passwd: passwd, Group: passwd, Token: "t"})
	if err != nil {
		b.Fatal(err)
	}
	sock := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	go s.Serve(l)
	defer s.Shutdown(context.Background())
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, "t")
	defer c.Close()
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
