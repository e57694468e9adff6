package cluster

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/testutil"
)

// fakeAPIServer answers the front's informers' lists with objs (by path)
// and holds their watches open with nothing in them: enough of a cluster
// for a front to route requests, with no control plane.
func fakeAPIServer(t *testing.T, objs map[string]any) *kube.Client {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("watch") == "true" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			http.NewResponseController(w).Flush()
			<-r.Context().Done()
			return
		}
		items, ok := objs[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"metadata": map[string]any{"resourceVersion": "1"}, "items": items})
	}))
	t.Cleanup(srv.Close)
	c, err := kube.New(&kube.Config{Server: srv.URL}, kube.Options{QPS: 1000, Burst: 1000})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// linesOf are the JSON lines of a log's output whose message is msg.
func linesOf(out *testutil.SyncBuffer, msg string) []map[string]any {
	var lines []map[string]any
	for _, l := range strings.Split(out.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg {
			lines = append(lines, m)
		}
	}
	return lines
}

// TestForwardFailuresLogBounded: a sandbox's node does not answer (its
// addresses refuse connections) but its lease is not yet expired, and
// anyone who reaches the proxy (and, with a key, the API) sends 300
// requests for the sandbox. Expected: each is a 502, and the front logs
// at most one line a second per node and kind, the next line counting
// those left out (before: a line per request, unbounded, filling the
// host's log and the journal's rate limit the daemon's lines share).
func TestForwardFailuresLogBounded(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := "http://" + l.Addr().String()
	l.Close() // nothing listens there now: connections are refused
	const id = "0123456789abcdef0123"
	now := metav1.NewMicroTime(time.Now())
	secs := int32(3600)
	c := fakeAPIServer(t, map[string]any{
		"/api/v1/namespaces/" + testNS + "/pods": []corev1.Pod{{
			ObjectMeta: metav1.ObjectMeta{Name: id, Namespace: testNS,
				Labels: map[string]string{LabelSandbox: "true", LabelKey: "owner1"}},
			Spec: corev1.PodSpec{NodeName: "b"}}},
		"/api/v1/nodes": []corev1.Node{{ObjectMeta: metav1.ObjectMeta{Name: "b",
			Labels:      map[string]string{NodeLabel: "true"},
			Annotations: map[string]string{AnnoAPI: refused, AnnoProxy: refused}}}},
		"/apis/coordination.k8s.io/v1/namespaces/" + NodeLeaseNamespace + "/leases": []coordinationv1.Lease{{
			ObjectMeta: metav1.ObjectMeta{Name: "b", Namespace: NodeLeaseNamespace},
			Spec:       coordinationv1.LeaseSpec{RenewTime: &now, LeaseDurationSeconds: &secs}}},
	})
	var out testutil.SyncBuffer
	f := NewFront(FrontConfig{Client: c, Namespace: testNS, NodeName: "a", NodeKey: nodeKey(t),
		Log: slog.New(slog.NewJSONHandler(&out, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := f.Start(ctx); err != nil {
		t.Fatal(err)
	}

	const n = 300
	send := func(i int) {
		w := httptest.NewRecorder()
		var handled bool
		if i%2 == 0 {
			handled = f.ForwardTraffic(w, httptest.NewRequest("GET", "http://49983-"+id+".cage.test/health", nil), id)
		} else {
			handled = f.Forward(w, httptest.NewRequest("GET", "/sandboxes/"+id, nil), id, "owner1")
		}
		if !handled || w.Code != http.StatusBadGateway {
			t.Fatalf("request %d: forwarded %v, %d %s; want a 502", i, handled, w.Code, w.Body)
		}
	}
	start := time.Now()
	for i := range n {
		send(i)
	}
	took := time.Since(start)
	// One more of each kind past the interval: its line counts the
	// burst's left out.
	time.Sleep(1100 * time.Millisecond)
	send(n)
	send(n + 1)
	for _, msg := range []string{"cluster: forward to node", "cluster: forward traffic to node"} {
		lines := linesOf(&out, msg)
		most := 2 + int(took/time.Second) // the burst's seconds, and the one after
		if len(lines) == 0 || len(lines) > most {
			t.Fatalf("%q: %d lines for %d failed forwards in %v, want 1 to %d", msg, len(lines), n/2+1, took, most)
		}
		total := len(lines)
		for _, m := range lines {
			k, _ := m["not_logged_before"].(float64)
			total += int(k)
			if m["node"] != "b" {
				t.Errorf("line %v does not name the node", m)
			}
		}
		if total != n/2+1 {
			t.Errorf("%q: %d lines and their counts of those left out add to %d, want %d", msg, len(lines), total, n/2+1)
		}
		t.Logf("%q: %d lines for %d failed forwards in %v", msg, len(lines), n/2+1, took)
	}
}
