package daemontest

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// TestMetricsOverTime: GET /sandboxes/{id}/metrics is a series sampled
// every 5 s from 5 s after the start, bounded by start and end; a paused
// sandbox is not sampled; a bad range is 400.
func TestMetricsOverTime(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, nil)
	path := "/sandboxes/" + sb.SandboxID + "/metrics"
	var ms []types.SandboxMetric
	d.expect(t, http.StatusOK, call{method: "GET", path: path, key: d.key}).decode(t, &ms)
	if len(ms) != 0 {
		t.Errorf("right after create: %d samples, want none (E2B's first comes after 5 s)", len(ms))
	}
	for _, bad := range []string{"?start=abc", "?end=1.5", "?start=-5", "?start=2000&end=1000"} {
		d.expect(t, http.StatusBadRequest, call{method: "GET", path: path + bad, key: d.key, invalid: true})
	}
	d.metricsAfter(t, d.key, sb.SandboxID, time.Now().Add(5*time.Second))
	d.expect(t, http.StatusOK, call{method: "GET", path: path, key: d.key}).decode(t, &ms)
	if len(ms) < 2 {
		t.Fatalf("after about 10 s: %d samples", len(ms))
	}
	for i := 1; i < len(ms); i++ {
		if step := ms[i].Timestamp.Sub(ms[i-1].Timestamp); step < 4*time.Second || step > 7*time.Second {
			t.Errorf("samples %d and %d are %v apart, want about 5 s", i-1, i, step)
		}
	}
	// A range holding only the last sample.
	last := ms[len(ms)-1].TimestampUnix
	var one []types.SandboxMetric
	d.expect(t, http.StatusOK, call{method: "GET", path: path + "?start=" + strconv.FormatInt(last, 10) + "&end=" + strconv.FormatInt(last, 10), key: d.key}).decode(t, &one)
	if len(one) != 1 || one[0].TimestampUnix != last {
		t.Errorf("start=end=%d: %+v, want the one sample of that second", last, one)
	}

	// Paused: no samples; resumed: samples again.
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/pause", key: d.key, body: map[string]any{}})
	paused := time.Now()
	time.Sleep(11 * time.Second)
	resumed := time.Now()
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + sb.SandboxID + "/connect", key: d.key, body: map[string]any{"timeout": 120}})
	d.metricsAfter(t, d.key, sb.SandboxID, resumed)
	d.expect(t, http.StatusOK, call{method: "GET", path: path, key: d.key}).decode(t, &ms)
	for _, m := range ms {
		if m.Timestamp.After(paused.Add(time.Second)) && m.Timestamp.Before(resumed) {
			t.Errorf("a sample at %v, %v into the 11 s the sandbox was paused", m.Timestamp, m.Timestamp.Sub(paused))
		}
	}
	d.kill(t, d.key, sb.SandboxID)
	d.expect(t, http.StatusNotFound, call{method: "GET", path: path, key: d.key})
}
