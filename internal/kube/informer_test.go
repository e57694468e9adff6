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
	// The first watch is waited for (a loaded host starts it late), then
	// counted over 1.5 s from it: each after a backoff (0.8 s, doubling).
	for deadline := time.Now().Add(10 * time.Second); watches.Load() < 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no watch 10 s after the sync (lists %d)", lists.Load())
		}
	}
	w0 := watches.Load()
	time.Sleep(1500 * time.Millisecond)
	if n := watches.Load() - w0; n > 2 {
		t.Fatalf("%d more watches in the 1.5 s after the first (lists %d): want at most 2, each after a backoff", n, lists.Load())
	}
}
