package logbound

import (
	"strconv"
	"testing"
	"time"
)

// TestAllow: of 1,000 lines for one key in a burst, one is let through;
// after the interval the next is, with the 999 held back counted; another
// key has its own interval; past maxKeys keys, new keys share one
// (the limiter's memory is bounded whatever the keys).
func TestAllow(t *testing.T) {
	l := &Limiter{Every: 200 * time.Millisecond}
	start := time.Now()
	allowed := 0
	for range 1000 {
		if ok, _ := l.Allow("node-a"); ok {
			allowed++
		}
	}
	if time.Since(start) < l.Every && allowed != 1 {
		t.Fatalf("%d of 1,000 lines in a burst let through, want 1", allowed)
	}
	if ok, _ := l.Allow("node-b"); !ok {
		t.Error("another key's first line held back")
	}
	time.Sleep(l.Every)
	ok, skipped := l.Allow("node-a")
	if !ok || skipped != 1000-allowed {
		t.Errorf("after the interval: %v, %d held back counted; want true, %d", ok, skipped, 1000-allowed)
	}
	for i := range 3 * maxKeys {
		l.Allow(strconv.Itoa(i))
	}
	if n := len(l.keys); n > maxKeys+1 {
		t.Errorf("%d keys remembered, want at most %d", n, maxKeys+1)
	}
}
