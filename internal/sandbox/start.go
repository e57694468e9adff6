package sandbox

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// Image templates may carry an E2B-style start command and ready check, as
// the labels cage.start and cage.ready (set with LABEL in a Dockerfile, or
// by any image tool): the start command is run in the background when a
// sandbox starts, and the create returns once the ready check exits 0.

const (
	LabelStart        = "cage.start"
	LabelReady        = "cage.ready"
	LabelReadyTimeout = "cage.ready-timeout" // seconds; default ReadyTimeout
)

// ReadyTimeout is how long a create waits for a template's ready check.
var ReadyTimeout = 60 * time.Second

// startCommand runs t's start command in sb and waits for its ready check.
func startCommand(sb wall.Sandbox, t *template.Template) error {
	if t == nil || t.Image == nil || t.Build {
		return nil // a build's RUN steps do not start the image's service
	}
	labels := t.Image.Info.Config.Labels
	start, ready := labels[LabelStart], labels[LabelReady]
	if start == "" {
		return nil
	}
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	timeout := ReadyTimeout
	if v, err := strconv.ParseFloat(labels[LabelReadyTimeout], 64); err == nil && v > 0 && v <= 3600 {
		timeout = time.Duration(v * float64(time.Second))
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// The shell is the image's and the agent relays what it says: only
	// the head is kept, for the error (an image's /bin/sh that wrote
	// without end grew the daemon's memory until the ready timeout).
	out := &headWriter{max: maxStartOutput}
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh",
		Args:   []string{"-c", `/bin/sh -c "$0" >/tmp/cage-start.log 2>&1 </dev/null &`, start},
		Stdout: out, Stderr: out})
	if err != nil {
		return fmt.Errorf("template %s: start command: %w", t.Name, err)
	}
	if end.GetExitCode() != 0 {
		return fmt.Errorf("template %s: start command could not be started (exit %d): %s", t.Name, end.GetExitCode(), strings.TrimSpace(out.String()))
	}
	if ready == "" {
		return nil
	}
	for {
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", ready}, Stdout: io.Discard, Stderr: io.Discard})
		if err == nil && end.GetExitCode() == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("template %s: not ready after %v (ready check %q; the start command's output is in /tmp/cage-start.log)", t.Name, timeout, ready)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// maxStartOutput is what a start command's error shows of its output.
const maxStartOutput = 4 << 10

// headWriter keeps the first max bytes written to it and drops the rest.
type headWriter struct {
	max int
	b   []byte
}

func (w *headWriter) Write(p []byte) (int, error) {
	if room := w.max - len(w.b); room > 0 {
		w.b = append(w.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (w *headWriter) String() string { return string(w.b) }
