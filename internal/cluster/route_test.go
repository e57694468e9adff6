package cluster

import (
	"net/http/httptest"
	"testing"
)

// A request counts as forwarded by a node (its rates already taken) only
// with a signature that verifies under the cluster's key, made for this
// node's API: a client that sends the header itself, another key's
// signature, one made for another node, or one a sandbox saw on traffic
// forwarded to it, gets its rates taken as any request.
func TestForwardedNeedsSignature(t *testing.T) {
	key, other := nodeKey(t), nodeKey(t)
	f := &Front{cfg: FrontConfig{NodeKey: key, NodeName: "b"}}
	r := httptest.NewRequest("GET", "/sandboxes/0123456789abcdef0123", nil)
	Sign(r, key, "a", "b", ForAPI)
	if !f.Forwarded(r) {
		t.Fatal("a signed request is not seen as forwarded")
	}
	r.URL.Path = "/sandboxes/ffffffffffffffffffff"
	if f.Forwarded(r) {
		t.Fatal("a request whose path changed after signing is seen as forwarded")
	}
	r = httptest.NewRequest("GET", "/sandboxes/0123456789abcdef0123", nil)
	r.Header.Set(AuthHeader, "node=a,t=1,sig=00")
	if f.Forwarded(r) {
		t.Fatal("a made-up header is seen as forwarded")
	}
	Sign(r, other, "a", "b", ForAPI)
	if f.Forwarded(r) {
		t.Fatal("another cluster's signature is seen as forwarded")
	}
	Sign(r, key, "a", "c", ForAPI)
	if f.Forwarded(r) {
		t.Fatal("a signature made for node c is seen as forwarded to b")
	}
	for _, p := range []Purpose{ForTraffic, ForInternal} {
		Sign(r, key, "a", "b", p)
		if f.Forwarded(r) {
			t.Fatalf("a signature made for %s is seen as a forwarded API request", p)
		}
	}
}
