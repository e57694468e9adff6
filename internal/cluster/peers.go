package cluster

import (
	"fmt"
	"net/http"
	"net/netip"
	"net/url"

	"github.com/cagehq/cage/internal/proxy"
)

// Forwards and the owner's connection bounds. What a front forwards to an
// owner node arrives from the front's one address, and the front opens
// one connection to the owner per request in flight (its transport is
// HTTP/1.1). The owner's listeners hold each client address to
// conns_per_client connections, so one tenant holding requests open to
// its own sandboxes on a node through a front made every other forward of
// that front to the node fail (502) until it let go (found by review,
// 2026-12-03). So:
//
//   - an owner's listeners do not hold the cluster's cage nodes (the hosts
//     of their API and proxy annotations) to the per-client bound, only
//     to the bound on all connections (Peer);
//   - a front holds each of its clients to conns_per_client forwards in
//     flight to each node (holdForward): what the client would get were
//     it to reach the node itself. (A client's HTTP/2 connection to the
//     proxy carries up to 100 requests, each its own forward.)

// Peer reports whether addr is another cage node of the cluster's: the
// host of one of its API or proxy annotations.
func (f *Front) Peer(addr netip.Addr) bool {
	if f == nil || !addr.IsValid() {
		return false
	}
	for _, n := range f.nodes.List() {
		if n.Name == f.cfg.NodeName {
			continue
		}
		for _, anno := range []string{AnnoAPI, AnnoProxy} {
			u, err := url.Parse(n.Annotations[anno])
			if err != nil {
				continue
			}
			if a, err := netip.ParseAddr(u.Hostname()); err == nil && a.Unmap() == addr {
				return true
			}
		}
	}
	return false
}

// forwardKey is one client's forwards to one node: the client as the
// proxy and the listeners count one (proxy.ClientOf: an IPv4 address, an
// IPv6 /64). By whole address, a /64 took PerClient forwards to a node for
// each of its addresses (found by review, 2026-12-04).
type forwardKey struct {
	node   string
	client string
}

// holdForward counts a forward of r's client to node, or answers 503 and
// returns false when the client has FrontConfig.PerClient in flight there
// already; done ends the forward.
func (f *Front) holdForward(w http.ResponseWriter, r *http.Request, node string, fail func(http.ResponseWriter, int, string)) (done func(), ok bool) {
	if f.cfg.PerClient <= 0 {
		return func() {}, true
	}
	k := forwardKey{node: node, client: proxy.ClientOf(r)}
	f.mu.Lock()
	if f.forwards[k] >= f.cfg.PerClient {
		f.mu.Unlock()
		fail(w, http.StatusServiceUnavailable, fmt.Sprintf("%d requests from your address are in flight to node %s already; try again when some have ended", f.cfg.PerClient, node))
		return nil, false
	}
	f.forwards[k]++
	f.mu.Unlock()
	return func() {
		f.mu.Lock()
		if f.forwards[k]--; f.forwards[k] <= 0 {
			delete(f.forwards, k)
		}
		f.mu.Unlock()
	}, true
}
