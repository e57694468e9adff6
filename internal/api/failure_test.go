package api

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/volume"
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

// TestVolumeContentUnavailableNamesNoHostPath: the volume content API
// (a volume's token, not an API key) answers a host that cannot do what
// was asked as the control API does: one line that stops before the
// clause naming a host path, with a request id for the rest in the log.
// Found by review, 2026-12-04: it answered the error whole, so the
// token's holder read the host's paths that the API's own routes hide.
func TestVolumeContentUnavailableNamesNoHostPath(t *testing.T) {
	var log strings.Builder
	s := &server{log: slog.New(slog.NewTextHandler(&log, nil))}
	r := httptest.NewRequest(http.MethodGet, "/volumecontent/v1/file?path=/a", nil)
	for _, c := range []struct {
		err        error
		want, hide string
	}{
		{fmt.Errorf("%w: volumes need loop devices: open /srv/ops/dev/loop-control: permission denied", volume.ErrUnavailable),
			"unavailable on this host: volumes need loop devices (request ", "/srv/ops"},
		{fmt.Errorf("%w: this server keeps no volumes", sandbox.ErrUnavailable), "unavailable on this host: this server keeps no volumes", ""},
	} {
		log.Reset()
		w := httptest.NewRecorder()
		s.contentFail(w, r, c.err)
		var e types.VolumeContentError
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil {
			t.Fatalf("%v: %s", c.err, w.Body.String())
		}
		if w.Code != http.StatusInternalServerError || !strings.HasPrefix(e.Message, c.want) || strings.Contains(e.Message, "\n") {
			t.Errorf("%v: %d %q, want 500 %q...", c.err, w.Code, e.Message, c.want)
		}
		if c.hide == "" {
			if e.Message != c.want || log.Len() != 0 {
				t.Errorf("%v: %q (log %q): want it whole, unlogged", c.err, e.Message, log.String())
			}
			continue
		}
		if strings.Contains(e.Message, c.hide) || !strings.Contains(log.String(), c.hide) {
			t.Errorf("%v: client %q, log %q", c.err, e.Message, log.String())
		}
	}
}
