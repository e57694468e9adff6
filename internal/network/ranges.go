package network

import (
	"encoding/binary"
	"net/netip"
	"slices"
)

// alwaysDenied are the IPv4 ranges no sandbox reaches, whatever its policy:
// private and special ranges, link-local (cloud metadata at 169.254.169.254
// is in it), and the metadata addresses of clouds that put them elsewhere.
// An operator may open a range again in the configuration (Config.Open); the
// sandbox subnet itself is never opened.
var alwaysDenied = []string{
	"0.0.0.0/8",          // "this network"
	"10.0.0.0/8",         // private
	"100.64.0.0/10",      // carrier-grade NAT (Alibaba's metadata 100.100.100.200 is in it)
	"127.0.0.0/8",        // loopback (outside the sandbox)
	"169.254.0.0/16",     // link-local: AWS, GCP, Azure, OpenStack metadata
	"172.16.0.0/12",      // private
	"192.0.0.0/24",       // IETF protocol assignments
	"192.168.0.0/16",     // private
	"198.18.0.0/15",      // benchmarking
	"224.0.0.0/4",        // multicast
	"240.0.0.0/4",        // reserved, and the broadcast address
	"168.63.129.16/32",   // Azure's wire server
	"100.100.100.200/32", // Alibaba Cloud metadata (inside 100.64/10 too)
}

// span is an inclusive range of IPv4 addresses.
type span struct{ lo, hi uint32 }

func prefixSpan(p netip.Prefix) span {
	p = p.Masked()
	a := p.Addr().As4()
	lo := binary.BigEndian.Uint32(a[:])
	return span{lo, lo | uint32(uint64(1)<<(32-p.Bits())-1)}
}

func u32(a netip.Addr) uint32 {
	b := a.As4()
	return binary.BigEndian.Uint32(b[:])
}

func addr(v uint32) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// merge sorts spans and joins those that overlap or touch.
func merge(in []span) []span {
	s := slices.Clone(in)
	slices.SortFunc(s, func(a, b span) int {
		if a.lo < b.lo {
			return -1
		}
		if a.lo > b.lo {
			return 1
		}
		return 0
	})
	var out []span
	for _, x := range s {
		if n := len(out); n > 0 && (x.lo <= out[n-1].hi || out[n-1].hi != ^uint32(0) && x.lo == out[n-1].hi+1) {
			out[n-1].hi = max(out[n-1].hi, x.hi)
			continue
		}
		out = append(out, x)
	}
	return out
}

// subtract removes cut from each span of in (both merged).
func subtract(in, cut []span) []span {
	var out []span
	for _, x := range in {
		parts := []span{x}
		for _, c := range cut {
			var next []span
			for _, p := range parts {
				if c.hi < p.lo || c.lo > p.hi {
					next = append(next, p)
					continue
				}
				if c.lo > p.lo {
					next = append(next, span{p.lo, c.lo - 1})
				}
				if c.hi < p.hi {
					next = append(next, span{c.hi + 1, p.hi})
				}
			}
			parts = next
		}
		out = append(out, parts...)
	}
	return out
}

// deniedSpans is what a sandbox may never reach: the always-denied ranges
// less what the operator opened, plus the sandbox subnet.
func deniedSpans(open []netip.Prefix, subnet netip.Prefix) []span {
	var d, o []span
	for _, s := range alwaysDenied {
		d = append(d, prefixSpan(netip.MustParsePrefix(s)))
	}
	for _, p := range open {
		o = append(o, prefixSpan(p))
	}
	return merge(append(subtract(merge(d), merge(o)), prefixSpan(subnet)))
}

// denied reports whether a is in spans.
func denied(spans []span, a netip.Addr) bool {
	if !a.Is4() {
		return true
	}
	v := u32(a)
	for _, s := range spans {
		if v >= s.lo && v <= s.hi {
			return true
		}
	}
	return false
}
