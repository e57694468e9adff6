package kube

import (
	"testing"
	"time"
)

// TestQueue: a key queued twice is handed out once; a key added while a
// worker has it is handed out again only after Done; ShutDown ends Get.
func TestQueue(t *testing.T) {
	q := NewQueue()
	q.Add("a")
	q.Add("b")
	q.Add("a")
	if q.Len() != 2 {
		t.Fatalf("len %d, want 2", q.Len())
	}
	k, _ := q.Get()
	if k != "a" {
		t.Fatalf("first %q", k)
	}
	q.Add("a") // while a is being worked on
	k2, _ := q.Get()
	if k2 != "b" || q.Len() != 0 {
		t.Fatalf("second %q, len %d: a was handed out while a worker had it", k2, q.Len())
	}
	q.Done("a")
	q.Done("b")
	if k, _ := q.Get(); k != "a" {
		t.Fatalf("a added during its work: got %q", k)
	}
	q.Done("a")
	q.AddRateLimited("c") // 5 ms
	q.AddRateLimited("c") // 10 ms
	q.AddAfter("d", 20*time.Millisecond)
	got := map[string]bool{}
	for len(got) < 2 {
		k, quit := q.Get()
		if quit {
			t.Fatal("quit")
		}
		got[k] = true
		q.Done(k)
	}
	if !got["c"] || !got["d"] {
		t.Fatalf("got %v", got)
	}
	q.Forget("c")
	done := make(chan bool)
	go func() { _, quit := q.Get(); done <- quit }()
	q.ShutDown()
	if !<-done {
		t.Fatal("Get did not quit at ShutDown")
	}
}
