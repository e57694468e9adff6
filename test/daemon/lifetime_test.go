package daemontest

import (
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestLifetimes checks that a sandbox ends at its timeout, with everything
// it had on the host, and that setting its timeout moves its end.
func TestLifetimes(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	key := d.key

	t.Run("expires", func(t *testing.T) {
		t.Parallel()
		// A 2 s sandbox is gone within 15 s: from the API, its cgroups and
		// its run directory.
		sb := d.create(t, key, map[string]any{"timeout": 2})
		dir := filepath.Join(d.runDir, "sandboxes", sb.SandboxID)
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("a running sandbox has no %s: %v", dir, err)
		}
		if len(cgroupDirs(sb.SandboxID)) == 0 {
			t.Errorf("a running sandbox has no cgroup")
		}
		start := time.Now()
		why := eventually(15*time.Second, func() string {
			if r := d.do(t, call{method: "GET", path: "/sandboxes/" + sb.SandboxID, key: key}); r.status != http.StatusNotFound {
				return "still there: " + r.String()
			}
			return ""
		})
		if why != "" {
			t.Errorf("a sandbox with timeout 2 is %s after 15 s", why)
			return
		}
		t.Logf("timeout 2: gone from the API after %v", time.Since(start).Round(10*time.Millisecond))
		d.checkGone(t, sb.SandboxID, 5*time.Second)
		for _, l := range d.list(t, key, nil) {
			if l.SandboxID == sb.SandboxID {
				t.Errorf("timed-out sandbox %s still listed", sb.SandboxID)
			}
		}
		d.expect(t, http.StatusNotFound, call{method: "DELETE", path: "/sandboxes/" + sb.SandboxID, key: key})
	})
	t.Run("extended", func(t *testing.T) {
		t.Parallel()
		extended(t, d)
	})
}

// extended: timeout 10, then set to 60: 2 s after the first 10 s would
// have ended it, it is still there and works; then set to 1 and it goes.
// Its clock starts as its create begins, so the extension must land
// within those 10 s: a loaded host took more than 3 s for the create and
// the extension.
func extended(t *testing.T, d *daemon) {
	key := d.key
	began := time.Now()
	sb := d.create(t, key, map[string]any{"timeout": 10})
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/timeout", key: key,
		body: map[string]any{"timeout": 60}})
	if end := d.get(t, key, sb.SandboxID).EndAt; !about(end, 60*time.Second) {
		t.Errorf("after setting timeout 60, endAt is %v from now", time.Until(end))
	}
	time.Sleep(time.Until(began.Add(12 * time.Second)))
	got := d.get(t, key, sb.SandboxID)
	if got.State != "running" {
		t.Errorf("extended sandbox state %q", got.State)
	}
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	if out := mustRun(t, ac, "echo still here"); out != "still here\n" {
		t.Errorf("extended sandbox: %q", out)
	}
	// Shortening works too: set 1 s and it goes.
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/timeout", key: key,
		body: map[string]any{"timeout": 1}})
	if why := eventually(15*time.Second, func() string {
		if r := d.do(t, call{method: "GET", path: "/sandboxes/" + sb.SandboxID, key: key}); r.status != http.StatusNotFound {
			return r.String()
		}
		return ""
	}); why != "" {
		t.Errorf("a sandbox whose timeout was set to 1 s is still there after 15 s: %s", why)
	}
	d.checkGone(t, sb.SandboxID, 5*time.Second)
}
