package agent

import "testing"

// TestReserveThreads: the agent ends up holding at least the threads it
// asked for, reading its thread count once per batch of pins.
func TestReserveThreads(t *testing.T) {
	before := threadCount()
	if before == 0 {
		t.Skip("no /proc/self/status")
	}
	want := before + 6
	reserveThreads(want)
	if got := threadCount(); got < want {
		t.Fatalf("after reserveThreads(%d): %d threads (had %d)", want, got, before)
	}
	// Already enough: nothing more is started.
	n := threadCount()
	reserveThreads(n - 1)
	if got := threadCount(); got > n+1 {
		t.Errorf("reserveThreads(%d) with %d threads already: now %d", n-1, n, got)
	}
}
