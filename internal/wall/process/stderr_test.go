package process

import (
	"bytes"
	"io"
	"log/slog"
	"strings"
	"testing"
)

// Attack: a sandbox's agent (inside the wall: the sandbox's to replace)
// writes to its stderr without end. The host kept a 4 KiB tail, but at
// --debug logged every chunk: the daemon's log grew at the agent's write
// rate (a host's journal or disk). Expected: at most maxLoggedStderr
// bytes of it are logged, then one line saying the rest is not; the
// tail is still the last bytes.
func TestAgentStderrLogBounded(t *testing.T) {
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug}))
	tb := newTailBuffer(4096)
	r, w := io.Pipe()
	go func() {
		chunk := []byte(strings.Repeat("x", 4095) + "\n")
		for range (64 << 20) / len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
		_, _ = w.Write([]byte("the end\n"))
		w.Close()
	}()
	tb.drain(r, log)
	if n := logged.Len(); n > 2*maxLoggedStderr {
		t.Errorf("%d KiB of the daemon's log for 64 MiB of the agent's stderr, want at most %d KiB", n>>10, 2*maxLoggedStderr>>10)
	}
	if !strings.HasSuffix(tb.String(), "the end\n") || len(tb.String()) > 4096 {
		t.Errorf("the tail kept is %d bytes ending %q", len(tb.String()), tb.String()[max(0, len(tb.String())-10):])
	}
}
