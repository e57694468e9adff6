package bench

import (
	"strings"
	"testing"
	"time"
)

// TestMetricLine: the API server's counters are read by label, and a line
// that is not a sample is refused.
func TestMetricLine(t *testing.T) {
	l, v, ok := metricLine(`apiserver_request_total{code="201",component="apiserver",group="",resource="pods",subresource="binding",verb="POST",version="v1"} 42`)
	if !ok || v != 42 || l["resource"] != "pods" || l["subresource"] != "binding" || l["verb"] != "POST" {
		t.Errorf("parsed %v %v %v", l, v, ok)
	}
	for _, bad := range []string{"apiserver_request_total 3", `x{a="b"} notanumber`, `x{a="b"`} {
		if _, _, ok := metricLine(bad); ok {
			t.Errorf("%q parsed", bad)
		}
	}
}

// TestDelta takes the idle rate, scaled to the window, out of a window's
// counts, and drops what is left under half a request.
func TestDelta(t *testing.T) {
	t0 := time.Unix(1000, 0)
	a := APICounts{Requests: map[string]float64{"POST pods": 10, "PUT leases": 100}, Revision: 50, At: t0}
	b := APICounts{Requests: map[string]float64{"POST pods": 30, "PUT leases": 110}, Revision: 120, At: t0.Add(10 * time.Second)}
	idle := APIDelta{Requests: map[string]float64{"PUT leases": 5}, Revisions: 5}
	d := Delta(a, b, &idle, 5*time.Second) // idle: 5 lease renewals in 5 s -> 10 in this window
	if d.Total != 20 || d.Requests["POST pods"] != 20 || d.Requests["PUT leases"] != 0 {
		t.Errorf("delta %+v", d)
	}
	if d.Revisions != 60 {
		t.Errorf("revisions %v, want 70 - 10 idle", d.Revisions)
	}
	if top := d.Top(3, 10); !strings.HasPrefix(top, "POST pods 2.00") {
		t.Errorf("top %q", top)
	}
}
