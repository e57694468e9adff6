package api

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/sandbox"
)

// TestUnavailableNamesNoHostPath: a 503 tells the client why in one line,
// without the host's paths (the daemon's directories, a kernel's, the
// free space under them): those go to the log, with the request id the
// client gets (found by review, 2026-12-03: a tenant asking for the
// microvm wall read where the operator keeps guest kernels).
func TestUnavailableNamesNoHostPath(t *testing.T) {
	var log strings.Builder
	s := &server{log: slog.New(slog.NewTextHandler(&log, nil))}
	r := httptest.NewRequest(http.MethodPost, "/v2/sandboxes", nil)
	for _, c := range []struct {
		err        error
		want, hide string
	}{
		{fmt.Errorf("%w: the microvm wall needs a guest kernel (scripts/kernel.sh, or set CAGE_KERNEL_DIR): no guest kernel in /srv/ops/kernel (boot/vmlinuz-VERSION)", sandbox.ErrUnavailable),
			"unavailable on this host: the microvm wall needs a guest kernel (scripts/kernel.sh, or set CAGE_KERNEL_DIR) (request ", "/srv/ops"},
		{fmt.Errorf("%w: not enough disk space to save its files (12 MiB free under /var/lib/cage/paused, up to 300 MiB needed)", sandbox.ErrUnavailable),
			"unavailable on this host: not enough disk space to save its files (request ", "/var/lib"},
		{fmt.Errorf("%w: cgroups: open /sys/fs/cgroup/cage: permission denied", sandbox.ErrUnavailable),
			"unavailable on this host: cgroups (request ", "/sys/fs"},
		{fmt.Errorf("%w: cage-agent not found beside /opt/x/cage", sandbox.ErrUnavailable), "unavailable on this host (request ", "/opt/x"},
		{fmt.Errorf("%w: this server keeps no volumes", sandbox.ErrUnavailable), "unavailable on this host: this server keeps no volumes", ""},
		{fmt.Errorf("%w: no node has room for the sandbox (kube-scheduler: 0/3 nodes are available)", sandbox.ErrUnavailable),
			"unavailable on this host: no node has room for the sandbox (kube-scheduler: 0/3 nodes are available)", ""},
	} {
		log.Reset()
		code, msg := s.failure(r, c.err)
		if code != http.StatusServiceUnavailable || !strings.HasPrefix(msg, c.want) || strings.Contains(msg, "\n") {
			t.Errorf("%v: %d %q, want 503 %q...", c.err, code, msg, c.want)
		}
		if c.hide == "" {
			if msg != c.want || log.Len() != 0 {
				t.Errorf("%v: %q (log %q): want it whole, unlogged", c.err, msg, log.String())
			}
			continue
		}
		id := strings.TrimSuffix(strings.TrimPrefix(msg[len(c.want):], ""), "; the server's log has the detail)")
		if strings.Contains(msg, c.hide) || !strings.Contains(log.String(), c.hide) || !strings.Contains(log.String(), id) {
			t.Errorf("%v: client %q, log %q", c.err, msg, log.String())
		}
	}
}
