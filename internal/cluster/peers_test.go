package cluster

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestHoldForward: a front holds each client address to PerClient
// forwards in flight to one node (503 past it), what the client would get
// from the node itself; another node, or another client, is not held by
// it, and a forward that ends frees its place.
func TestHoldForward(t *testing.T) {
	f := &Front{cfg: FrontConfig{PerClient: 2}, forwards: map[forwardKey]int{}}
	req := func(from string) *http.Request {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = from + ":4000"
		return r
	}
	hold := func(from, node string) (func(), int) {
		w := httptest.NewRecorder()
		done, ok := f.holdForward(w, req(from), node, apiError)
		if !ok {
			return nil, w.Code
		}
		return done, 0
	}
	first, _ := hold("192.0.2.1", "c")
	if _, code := hold("192.0.2.1", "c"); code != 0 {
		t.Fatalf("a client's 2nd forward to c (bound 2): %d", code)
	}
	if _, code := hold("192.0.2.1", "c"); code != http.StatusServiceUnavailable {
		t.Errorf("a client's 3rd forward to c (bound 2): %d, want 503", code)
	}
	if _, code := hold("192.0.2.1", "b"); code != 0 {
		t.Errorf("the client's forward to another node: %d", code)
	}
	if _, code := hold("192.0.2.2", "c"); code != 0 {
		t.Errorf("another client's forward to c: %d", code)
	}
	first()
	if _, code := hold("192.0.2.1", "c"); code != 0 {
		t.Errorf("a forward after one ended: %d", code)
	}
}

// TestHoldForwardIPv6Prefix: a client holding an IPv6 /64 (one host's or
// network's, 2^64 addresses) is one client to a front's bound on its
// forwards, as it is to the listeners' bound on connections and to the
// proxy's anonymous shares: its other addresses get 503 past it, another
// /64 does not. Found by review, 2026-12-04: forwards were counted by
// whole address, so a /64 took PerClient forwards to a node for each of
// its addresses, up to what its connections carry (100 streams each).
func TestHoldForwardIPv6Prefix(t *testing.T) {
	f := &Front{cfg: FrontConfig{PerClient: 2}, forwards: map[forwardKey]int{}}
	hold := func(from string) int {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = "[" + from + "]:4000"
		w := httptest.NewRecorder()
		if _, ok := f.holdForward(w, r, "c", apiError); !ok {
			return w.Code
		}
		return 0
	}
	for _, a := range []string{"2001:db8:1:2::1", "2001:db8:1:2::2"} {
		if code := hold(a); code != 0 {
			t.Fatalf("forward from %s within the /64's bound: %d", a, code)
		}
	}
	if code := hold("2001:db8:1:2:ffff::3"); code != http.StatusServiceUnavailable {
		t.Errorf("a third forward from another address of the same /64 (bound 2): %d, want 503", code)
	}
	if code := hold("2001:db8:1:3::1"); code != 0 {
		t.Errorf("a forward from another /64: %d", code)
	}
}
