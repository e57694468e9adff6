package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil/kubeplane"
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

// TestByClient tallies an audit log's requests in the window by client,
// verb and resource: a watch by its start, others by their end, the
// admin's and non-resource requests left out.
func TestByClient(t *testing.T) {
	dir := t.TempDir()
	log := filepath.Join(dir, "audit.log")
	at := func(s string) string { return `"requestReceivedTimestamp":"2026-12-01T10:00:` + s + `Z"` }
	lines := []string{
		`{"stage":"ResponseComplete","user":{"username":"cage:node:a"},"verb":"create","objectRef":{"resource":"pods"},` + at("01") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"cage:node:b"},"verb":"delete","objectRef":{"resource":"pods"},` + at("02") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"cage:node:b"},"verb":"delete","objectRef":{"resource":"pods"},` + at("03") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"system:kube-scheduler"},"verb":"create","objectRef":{"resource":"pods","subresource":"binding"},` + at("04") + `}`,
		`{"stage":"ResponseStarted","user":{"username":"cage:node:a"},"verb":"watch","objectRef":{"resource":"pods"},` + at("05") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"cage:node:a"},"verb":"watch","objectRef":{"resource":"pods"},` + at("05") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"admin"},"verb":"list","objectRef":{"resource":"pods"},` + at("06") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"cage:node:a"},"verb":"get"` + `,` + at("07") + `}`,
		`{"stage":"ResponseComplete","user":{"username":"cage:node:a"},"verb":"create","objectRef":{"resource":"pods"},` + at("30") + `}`,
		`not json`,
	}
	if err := os.WriteFile(log, []byte(strings.Join(lines, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Plane: &kubeplane.Plane{AuditLog: log}}
	from, _ := time.Parse(time.RFC3339, "2026-12-01T10:00:00Z")
	got, err := c.ByClient(from, from.Add(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"node a CREATE pods": 1, "node b DELETE pods": 2, "scheduler CREATE pods/binding": 1, "node a WATCH pods": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("tally %v, want %v", got, want)
	}
}
