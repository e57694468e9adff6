package agent

import (
	"context"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/agentclient"
)

// A command's stdout and stderr are pipes of outputPipeSize: with the
// kernel's 64 KiB, a command writing much in small writes woke the agent
// at every write (gVisor's 1 GiB flood: 32-34 s here, 21-24 s widened).
func TestOutputPipesWidened(t *testing.T) {
	c := startLocalAgent(t)
	for _, fd := range []string{"1", "2"} {
		var out strings.Builder
		// F_GETPIPE_SZ is 1032; the answer goes to stdout either way.
		script := "import fcntl, sys; sys.__stdout__.write(str(fcntl.fcntl(" + fd + ", 1032)))"
		end, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "python3", Args: []string{"-c", script}, Stdout: &out, Stderr: io.Discard})
		if err != nil || end.GetExitCode() != 0 {
			t.Fatalf("fd %s: %v %v", fd, err, end)
		}
		if got, _ := strconv.Atoi(strings.TrimSpace(out.String())); got != outputPipeSize {
			t.Errorf("fd %s is a pipe of %q bytes; want %d", fd, out.String(), outputPipeSize)
		}
	}
}
