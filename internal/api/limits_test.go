package api

import (
	"testing"
	"time"
)

// TestTakeN: n tokens are taken at once or not at all, and n beyond the
// burst never fits: a fork of n sandboxes costs what n creates cost (it
// cost one: found by review, 2026-12-03, 12 sandboxes for one token of a
// key allowed 0.1 creates a second).
func TestTakeN(t *testing.T) {
	var l limiter
	now := time.Unix(1_700_000_000, 0)
	const rate = 1.0 // burst 2
	if ok, _ := l.takeN("k", rate, 3, now); ok {
		t.Fatal("3 tokens from a bucket of 2")
	}
	if ok, _ := l.takeN("k", rate, 2, now); !ok {
		t.Fatal("2 tokens from a full bucket of 2")
	}
	ok, wait := l.takeN("k", rate, 2, now)
	if ok || wait != 2*time.Second {
		t.Fatalf("2 more at once: %v, wait %v (want a refusal, 2 s)", ok, wait)
	}
	if ok, _ := l.takeN("k", rate, 1, now.Add(time.Second)); !ok {
		t.Fatal("1 token a second later")
	}
	if ok, _ := l.takeN("k", rate, 2, now.Add(2*time.Second)); ok {
		t.Fatal("2 tokens when 1 came back")
	}
	if ok, _ := l.takeN("k", rate, 1, now.Add(2*time.Second)); !ok {
		t.Fatal("the 1 token a refusal of 2 must have left")
	}
}
