package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
)

// TestBackgroundChildOutlivesItsCommand: a command that starts a
// background child and exits (xdg-open starting a browser, a shell's `&`)
// ends for its client at once, yet the child keeps running: it still
// writes to the stdout and stderr it inherited long after the end, and
// those writes neither kill it (SIGPIPE) nor block it once a pipe's
// buffer would have filled.
func TestBackgroundChildOutlivesItsCommand(t *testing.T) {
	c := startLocalAgent(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	done := filepath.Join(dir, "done")
	gate := filepath.Join(dir, "gate")
	if err := syscall.Mkfifo(gate, 0o600); err != nil {
		t.Fatal(err)
	}
	// The child waits for the test (which opens the gate only after the
	// command's end has come), then writes 256 KiB to each of its
	// inherited stdout and stderr (four times a pipe's buffer), then
	// leaves a mark if every write succeeded.
	script := fmt.Sprintf(`(read x < %s; head -c 262144 /dev/zero && head -c 262144 /dev/zero >&2 && echo ok > %s) &`, gate, done)
	var out strings.Builder
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &out})
	if err != nil || end.GetExitCode() != 0 {
		t.Fatalf("run: %v %v", err, end)
	}
	g, err := os.OpenFile(gate, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.WriteString("go\n"); err != nil {
		t.Fatal(err)
	}
	g.Close()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if b, err := os.ReadFile(done); err == nil && string(b) == "ok\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the background child never finished its writes: killed by SIGPIPE, or blocked on a pipe no one reads")
		}
	}
	if out.Len() != 0 {
		t.Errorf("the client got %d bytes the child wrote after the end", out.Len())
	}
}
