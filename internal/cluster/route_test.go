package cluster

import (
	"net/http/httptest"
	"testing"

	"github.com/cagehq/cage/internal/proxy"
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

// The client another node names on traffic it forwarded (for the owner
// proxy's per-client share of a sandbox's anonymous budget) is believed
// only under that node's signature made for traffic to this node: a
// client that sends the header itself, directly or with a signature made
// for something else, is counted by its own address.
func TestTrafficClientNeedsSignature(t *testing.T) {
	key, other := nodeKey(t), nodeKey(t)
	f := &Front{cfg: FrontConfig{NodeKey: key, NodeName: "b"}}
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set(proxy.ClientHeader, "192.0.2.7")
	if got := f.TrafficClient(r); got != "" {
		t.Fatalf("an unsigned request names its client %q", got)
	}
	Sign(r, key, "a", "b", ForTraffic)
	if got := f.TrafficClient(r); got != "192.0.2.7" {
		t.Fatalf("forwarded traffic names its client %q, want the front's 192.0.2.7", got)
	}
	for _, sign := range []func(){
		func() { Sign(r, other, "a", "b", ForTraffic) },
		func() { Sign(r, key, "a", "c", ForTraffic) },
		func() { Sign(r, key, "a", "b", ForAPI) },
		func() { r.Header.Set(AuthHeader, "node=a,t=1,sig=00") },
	} {
		sign()
		if got := f.TrafficClient(r); got != "" {
			t.Fatalf("a request without a good traffic signature (%s) names its client %q", r.Header.Get(AuthHeader), got)
		}
	}
}
