package kube

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestShortWatchBacksOff: a server (a proxy) that ends every watch at once
// with nothing in it makes the informer list again after its backoff, not
// watch again in a loop as fast as its rate limit allows.
func TestShortWatchBacksOff(t *testing.T) {
	var lists, watches atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("watch") == "true" {
			watches.Add(1)
			return // 200, no event
		}
		lists.Add(1)
		fmt.Fprint(w, `{"metadata":{"resourceVersion":"5"},"items":[{"metadata":{"name":"a","resourceVersion":"5"}}]}`)
	}))
	defer srv.Close()
	c, err := New(&Config{Server: srv.URL}, Options{QPS: 1000, Burst: 1000})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inf := NewInformer(c.CoreV1().Secrets("n"), metav1.ListOptions{})
	inf.Start(ctx)
	if !WaitForSync(ctx, inf.HasSynced) {
		t.Fatal("no sync")
	}
	if _, err := inf.Get("a"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if n := watches.Load(); n < 1 || n > 3 {
		t.Fatalf("%d watches in 1.5 s (lists %d): want 1 to 3, each after a backoff", n, lists.Load())
	}
}
