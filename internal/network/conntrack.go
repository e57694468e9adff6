package network

import (
	"errors"
	"net/netip"
	"slices"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// A policy change reaches the connections a sandbox already has: the host's
// conntrack entries of the sandbox's address whose destination the new
// policy refuses are deleted. The next packet the sandbox sends on such a
// connection is then new to the host's rules and refused (a TCP reset, see
// nftbase.go), and what the far end sends finds no translation back to the
// sandbox (the host answers it with a reset of its own). Connections the new
// policy allows are left alone.

// cutLocked deletes the tracked connections of the sandbox its current
// policy refuses. The caller holds sb.mu.
func (sb *Sandbox) cutLocked() error {
	f := flowFilter{sb: sb, now: time.Now()}
	_, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f)
	return err
}

type flowFilter struct {
	sb  *Sandbox
	now time.Time
}

// MatchConntrackFlow says whether the flow is one of the sandbox's that its
// policy refuses.
func (f flowFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	src, ok := netip.AddrFromSlice(flow.Forward.SrcIP)
	if !ok || src.Unmap() != f.sb.IP {
		return false
	}
	dst, ok := netip.AddrFromSlice(flow.Forward.DstIP)
	if !ok {
		return false
	}
	return !f.sb.allowsLocked(dst.Unmap(), flow.Forward.Protocol, flow.Forward.DstPort, f.now)
}

// allowsLocked is what the sandbox's chains decide for a new connection to
// dst (protocol proto, destination port port for TCP and UDP), mirrored in
// Go: see policyRules. The caller holds sb.mu.
func (sb *Sandbox) allowsLocked(dst netip.Addr, proto uint8, port uint16, now time.Time) bool {
	p := sb.policy
	ported := proto == unix.IPPROTO_TCP || proto == unix.IPPROTO_UDP
	if dst == sb.h.gateway {
		return ported && port == 53 // DNS to the resolver; nothing else of the host
	}
	if ported && (port == 53 || port == 853) {
		return false
	}
	if !dst.Is4() || denied(sb.h.denied, dst) {
		return false
	}
	portOK := func(want uint16) bool { return want == 0 || ported && port == want }
	for _, r := range p.Allow {
		if r.Name == "" && r.Prefix.Contains(dst) && portOK(r.Port) {
			return true
		}
	}
	for name, addrs := range sb.learned {
		if until, ok := addrs[dst]; ok && until.After(now) {
			if _, ports := p.NamePorts(name); slices.ContainsFunc(ports, portOK) {
				return true
			}
		}
	}
	if p.Mode != Internet {
		return false
	}
	for _, r := range p.Deny {
		if r.Name == "" && r.Prefix.Contains(dst) && portOK(r.Port) {
			return false
		}
	}
	_, in := sb.inY[dst]
	return !in
}

// forgetFlows deletes every tracked connection of address ip, whichever
// end it is: a slot's address passes to the next sandbox given the slot,
// and the host's rules accept what belongs to an established connection
// before they ask whose it is, so a connection the last holder left (a UDP
// flow its far end keeps alive, an idle TCP one for days) would otherwise
// be the next holder's, in and out, whatever its policy. A dump
// interrupted by the table changing is tried again.
// The ends waiting at once are forgotten together (reaper.go).
func forgetFlows(ip netip.Addr) error { return reaper.forget(ip) }

// forgetOne forgets ip's connections alone: the kernel finds them where it
// can (deleteFlowsByKernel); else this process walks the whole table.
func forgetOne(ip netip.Addr) error {
	_, err := deleteFlowsByKernel(ip)
	if errors.Is(err, errDumpInterrupted) {
		_, err = deleteFlowsByKernel(ip)
	}
	if err == nil {
		return nil
	}
	f := addrFilter{ip}
	_, err = netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f)
	if err != nil {
		_, err = netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f)
	}
	if err != nil {
		return errForget(ip, err)
	}
	return nil
}

type addrFilter struct{ ip netip.Addr }

// MatchConntrackFlow says whether ip is an end of the flow, either way.
func (f addrFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	for _, b := range [][]byte{flow.Forward.SrcIP, flow.Forward.DstIP, flow.Reverse.SrcIP, flow.Reverse.DstIP} {
		if a, ok := netip.AddrFromSlice(b); ok && a.Unmap() == f.ip {
			return true
		}
	}
	return false
}
