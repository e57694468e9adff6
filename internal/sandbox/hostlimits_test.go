package sandbox

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
)

// TestRaiseHostLimits: the kernel's host-wide limits every sandbox draws
// from (pids, threads, open files, ptys) end at least at what many
// sandboxes hold together, so that a tenant is bounded by its sandboxes'
// cgroups, not by a limit it can use up for everyone; raising them again
// changes nothing. It changes the host's sysctls as cage serve does.
func TestRaiseHostLimits(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	var buf bytes.Buffer
	RaiseHostLimits(slog.New(slog.NewTextHandler(&buf, nil)))
	if low := LowHostLimits(); len(low) > 0 {
		t.Fatalf("still low after RaiseHostLimits: %v\n%s", low, buf.String())
	}
	if strings.Contains(buf.String(), "WARN") {
		t.Errorf("warnings: %s", buf.String())
	}
	buf.Reset()
	RaiseHostLimits(slog.New(slog.NewTextHandler(&buf, nil)))
	if buf.Len() != 0 {
		t.Errorf("a second raise did something: %s", buf.String())
	}
	for _, l := range HostLimits {
		v, err := readSysctl(l.Path)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil || v < l.Min {
			t.Errorf("%s = %d (%v), want at least %d", l.Sysctl, v, err, l.Min)
		}
	}
}
