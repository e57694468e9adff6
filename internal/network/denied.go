package network

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// A name an internet-mode policy denies is kept from the sandbox by its
// addresses too, not only by NXDOMAIN (a sandbox may know an address, or
// learn it over DNS-over-HTTPS): the host resolves each exact denied name
// itself through the upstream resolvers, when the policy is set and again
// once half its TTL (clamped to 30 s–1 h) has passed, and the sandbox's
// chain refuses those addresses until their TTL ends. A name the sandbox
// asks for (a wildcard's subdomain included) is resolved the same way
// before it gets its NXDOMAIN. Should the upstreams fail, the last answer's
// addresses stay denied. What this cannot do: deny addresses the host's
// resolvers never give (a name that answers differently elsewhere), and it
// denies every other name at the same addresses (a shared CDN address).

// denyRefresh is how often the host looks for denied names due for a
// refresh, and for addresses whose TTL has passed.
var denyRefresh = 5 * time.Second

// denyLookupTimeout bounds the lookups a policy change (or an attach)
// waits for; a name not answered by then is retried at the next refresh.
const denyLookupTimeout = 3 * time.Second

type nameCache struct {
	mu      sync.Mutex
	entries map[string]*cachedName
}

type cachedName struct {
	addrs   []netip.Addr
	ttl     time.Duration
	fetched time.Time // of the last answer
	used    time.Time // last asked for
}

// lookupDenied returns the addresses of a denied name and their TTL: from
// the cache until half the TTL has passed, then from the upstream
// resolvers (keeping the cached answer if they fail).
func (h *Host) lookupDenied(ctx context.Context, name string) ([]netip.Addr, time.Duration, bool) {
	now := time.Now()
	h.names.mu.Lock()
	if h.names.entries == nil {
		h.names.entries = map[string]*cachedName{}
	}
	c := h.names.entries[name]
	if c != nil {
		c.used = now
		if now.Sub(c.fetched) < c.ttl/2 {
			defer h.names.mu.Unlock()
			return c.addrs, c.ttl, true
		}
	}
	h.names.mu.Unlock()
	ans, err := h.res.ask(ctx, new(dns.Msg).SetQuestion(name+".", dns.TypeA))
	h.names.mu.Lock()
	defer h.names.mu.Unlock()
	if c = h.names.entries[name]; c == nil {
		c = &cachedName{used: now}
		if len(h.names.entries) < maxCachedNames {
			h.names.entries[name] = c
		}
	}
	if err != nil {
		h.log.Warn("network: resolve a denied name; its last addresses stay denied", "name", name, "err", err)
		return c.addrs, c.ttl, len(c.addrs) > 0
	}
	c.addrs, c.ttl = answerAddrs(ans)
	c.fetched = time.Now()
	return c.addrs, c.ttl, true
}

// resolveDenied resolves the exact names p denies, within
// denyLookupTimeout: name -> address -> until when it stays denied.
func (h *Host) resolveDenied(p Policy) map[string]map[netip.Addr]time.Time {
	names := p.exactDenyNames()
	if len(names) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), denyLookupTimeout)
	defer cancel()
	out := map[string]map[netip.Addr]time.Time{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, name := range names {
		wg.Go(func() {
			addrs, ttl, ok := h.lookupDenied(ctx, name)
			if !ok {
				return
			}
			until := time.Now().Add(ttl)
			m := map[netip.Addr]time.Time{}
			for _, a := range addrs {
				m[a] = until
			}
			mu.Lock()
			out[name] = m
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// refreshDenied keeps the denied names' addresses of every sandbox fresh
// and forgets what outlived its TTL, until stop closes.
func (h *Host) refreshDenied(stop <-chan struct{}) {
	t := time.NewTicker(denyRefresh)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		h.refreshOnce()
	}
}

func (h *Host) refreshOnce() {
	type snap struct {
		sb  *Sandbox
		p   Policy
		gen uint64
	}
	h.mu.Lock()
	snaps := make([]snap, 0, len(h.bySlot))
	for _, sb := range h.bySlot {
		p, gen := sb.snapshot()
		snaps = append(snaps, snap{sb, p, gen})
	}
	h.mu.Unlock()
	// Each name once, whichever sandboxes deny it.
	var all Policy
	all.Mode = Internet
	seen := map[string]bool{}
	for _, s := range snaps {
		for _, name := range s.p.exactDenyNames() {
			if !seen[name] {
				seen[name] = true
				all.Deny = append(all.Deny, Rule{Name: name})
			}
		}
	}
	h.pruneNames(time.Now(), seen)
	answers := h.resolveDenied(all)
	for _, s := range snaps {
		for _, name := range s.p.exactDenyNames() {
			var list []netip.Addr
			var until time.Time
			for a, u := range answers[name] {
				list, until = append(list, a), u
			}
			err := s.sb.commit(s.gen, name, list, time.Until(until))
			if err != nil && !errors.Is(err, errStale) && !errors.Is(err, errGone) {
				h.log.Warn("network: deny a denied name's addresses", "sandbox", s.sb.ID, "name", name, "err", err)
			}
		}
		if err := s.sb.expire(time.Now()); err != nil {
			h.log.Warn("network: forget expired addresses", "sandbox", s.sb.ID, "err", err)
		}
	}
}

// The cache of denied names' answers holds at most maxCachedNames names,
// and a name no live sandbox's policy denies only for namesGrace after it
// was last asked for (a policy being set may just have asked for it); a
// name past the cap is looked up each time it is needed. Found by review,
// 2026-12-05: names stayed two hours after they were last asked for, and
// a key holder who set one sandbox's policy again and again, each time
// with 256 new denied names (24 changes a second here), had the daemon
// remember 6,000 more names a second.
const (
	maxCachedNames = 16384
	namesGrace     = 30 * time.Second
)

// pruneNames forgets the cached names that no live sandbox's policy
// denies (live) and that nobody asked for within namesGrace.
func (h *Host) pruneNames(now time.Time, live map[string]bool) {
	h.names.mu.Lock()
	defer h.names.mu.Unlock()
	for name, c := range h.names.entries {
		if !live[name] && now.Sub(c.used) > namesGrace {
			delete(h.names.entries, name)
		}
	}
}
