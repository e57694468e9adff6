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
