package agent

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
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

// localUser makes a root directory whose account file names the test's
// own user "user", with a home in it; it returns both.
func localUser(tb testing.TB) (dir, passwd string) {
	tb.Helper()
	dir = tb.TempDir()
	passwd = filepath.Join(dir, "passwd")
	home := filepath.Join(dir, "home")
	if err := os.Mkdir(home, 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(passwd, []byte(fmt.Sprintf("user:x:%d:%d::%s:/bin/sh\n", os.Getuid(), os.Getgid(), home)), 0o644); err != nil {
		tb.Fatal(err)
	}
	return dir, passwd
}

// startLocalAgent serves an agent in this process on a unix socket (the
// test's own user its sandbox user) and returns cage's client of it.
func startLocalAgent(tb testing.TB) *agentclient.Client {
	tb.Helper()
	dir, passwd := localUser(tb)
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

// TestHostListDir: the host's own reading of a listing (agentclient's
// ListDir, which keeps what it is asked for as the listing arrives) gets
// what the generated client gets from this agent, and the agent's errors
// with their codes. The agent's root holds passwd, home and its socket.
func TestHostListDir(t *testing.T) {
	c := startLocalAgent(t)
	ctx := context.Background()
	want, err := c.FS.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/"}))
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/"}), 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Entries) != 3 || l.Total != 3 || l.Truncated || !proto.Equal(&fspb.ListDirResponse{Entries: l.Entries}, want.Msg) {
		t.Errorf("got %d entries of %d (truncated %v), want the generated client's %d", len(l.Entries), l.Total, l.Truncated, len(want.Msg.GetEntries()))
	}
	l, err = c.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/"}), 2)
	if err != nil || len(l.Entries) != 2 || l.Total != 3 || !l.Truncated || l.Entries[1].GetName() != "home" {
		t.Errorf("keeping 2: %v, %+v", err, l)
	}
	_, err = c.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/none"}), 10)
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a directory that is not there: %v, want not_found", err)
	}
}
