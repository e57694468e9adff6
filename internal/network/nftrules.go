package network

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The shared chains' rules. A rule that needs a sandbox's elements looks
// its id up itself (registers do not outlive a rule): the interface's name
// and the source address are the key of the sbx map, whose value, the id,
// replaces them in the registers, followed by what the rule matches:
//
//	r0..r3: id (r0: its profile, r1: its log group)   r4: address   r5: port

// Registers (32-bit).
const (
	r0 = unix.NFT_REG32_00
	r1 = unix.NFT_REG32_01
	r4 = unix.NFT_REG32_04
	r5 = unix.NFT_REG32_05
	r6 = unix.NFT_REG32_06
	r7 = unix.NFT_REG32_07
)

// loadID puts the sandbox's id in r0..r3 (no match where the interface and
// the source address are no sandbox's).
func loadID() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: r0},
		&expr.Payload{DestRegister: r4, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Lookup{SourceRegister: r0, SetName: setSbx, DestRegister: r0, IsDestRegSet: true},
	}
}

// notSandbox matches a packet whose interface and source address are no
// sandbox's entry in sbx.
func notSandbox() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: r0},
		&expr.Payload{DestRegister: r4, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Lookup{SourceRegister: r0, SetName: setSbx, Invert: true},
	}
}

func load(reg uint32, base expr.PayloadBase, offset, n uint32) *expr.Payload {
	return &expr.Payload{DestRegister: reg, Base: base, Offset: offset, Len: n}
}

// connEnd matches a packet whose tracked connection has, as its original
// source (end 0) or destination (end 1), the address of the sandbox on the
// packet's interface: the connection is that sandbox's own. Conntrack
// accepts an ICMP error about any tracked connection as related to it,
// whoever sends it, so a sandbox that can forge ICMP (root in a microVM's
// guest, a compromised guest kernel) could otherwise ride another
// sandbox's or the host's connection past its own policy.
func connEnd(end int) []expr.Any {
	key := expr.CtKeySRC
	if end == 1 {
		key = expr.CtKeyDST
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: r0},
		// 16 bytes in an inet table (r4..r7); an IPv4 address fills r4.
		&expr.Ct{Register: r4, Key: key, Direction: 0},
		&expr.Lookup{SourceRegister: r0, SetName: setSbx},
	}
}

// ownConnAccept accepts a packet of an established connection, or one
// related to it, when the connection is the sending sandbox's own
// (connEnd); the caller decides what becomes of the others.
func ownConnAccept() [][]expr.Any {
	est := ctState(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED)
	return [][]expr.Any{
		cat(est, connEnd(0), verdict(expr.VerdictAccept)),
		cat(est, connEnd(1), verdict(expr.VerdictAccept)),
	}
}

// idLookup matches "id . ip daddr [. th dport]" in set.
func idLookup(set string, port bool) []expr.Any {
	e := cat(loadID(), []expr.Any{load(r4, expr.PayloadBaseNetworkHeader, 16, 4)})
	if port {
		e = append(e, load(r5, expr.PayloadBaseTransportHeader, 2, 2))
	}
	return append(e, &expr.Lookup{SourceRegister: r0, SetName: set})
}

// profileLookup matches "profile . ip daddr" in xdeny (the id's first word
// is its profile).
func profileLookup() []expr.Any {
	return cat(loadID(), []expr.Any{load(r1, expr.PayloadBaseNetworkHeader, 16, 4), &expr.Lookup{SourceRegister: r0, SetName: setXDeny}})
}

// logTo jumps to the owner's log chain through the map (loga or logd)
// keyed by the id's log group; no match where the owner has none.
func logTo(m string) []expr.Any {
	return cat(loadID(), []expr.Any{&expr.Lookup{SourceRegister: r1, SetName: m, DestRegister: 0, IsDestRegSet: true}})
}

// pastFlows matches a new connection of a source that has maxFlows
// tracked already (ct count: closed TCP connections left out), and counts
// it otherwise.
func pastFlows() []expr.Any {
	return []expr.Any{
		load(r6, expr.PayloadBaseNetworkHeader, 12, 4),
		&expr.Dynset{SrcRegKey: r6, SetName: setFlows, Operation: unix.NFT_DYNSET_OP_ADD,
			Exprs: []expr.Any{&expr.Connlimit{Count: maxFlows, Flags: expr.NFT_CONNLIMIT_F_INV}}},
	}
}

// newPastRate matches a new connection of a source past newRate a second
// (burst newBurst).
func newPastRate() []expr.Any {
	return []expr.Any{
		load(r6, expr.PayloadBaseNetworkHeader, 12, 4),
		&expr.Dynset{SrcRegKey: r6, SetName: setNewRate, Operation: unix.NFT_DYNSET_OP_UPDATE, Timeout: meterTimeout,
			Exprs: []expr.Any{&expr.Limit{Type: expr.LimitTypePkts, Rate: newRate, Unit: expr.LimitTimeSecond, Burst: newBurst, Over: true}}},
	}
}

// closedSoon gives a new TCP connection the ct timeout ctClosed (not a
// verdict: the rule falls through).
func closedSoon() []expr.Any {
	return cat(l4proto(unix.IPPROTO_TCP), []expr.Any{&expr.Objref{Type: int(nftables.ObjTypeCtTimeout), Name: ctClosed}})
}

// fromSandboxRules is the fromsbx chain: what a sandbox may send elsewhere.
func fromSandboxRules() [][]expr.Any {
	var rs [][]expr.Any
	add := func(e ...[]expr.Any) { rs = append(rs, cat(e...)) }
	accept, drop, refused := verdict(expr.VerdictAccept), verdict(expr.VerdictDrop), refuse()
	allowLogged := func(match ...[]expr.Any) {
		add(append(match, logTo(setLogA))...)
		add(append(match, accept)...)
	}
	// Denied connections are refused at once (ICMP "administratively
	// prohibited"; a TCP reset for a connection a policy change cut): a
	// program inside fails fast instead of timing out.
	denyLogged := func(match ...[]expr.Any) {
		add(append(match, logTo(setLogD))...)
		add(append(match, refused)...)
	}
	// IPv4 only, from a sandbox's own interface and address only.
	add(nfproto(unix.NFPROTO_IPV4, false), drop)
	add(notSandbox(), drop)
	// What conntrack finds invalid (no connection: a TCP segment with SYN
	// and FIN, an ICMP error about nothing tracked), or does not track (a
	// notrack rule of the host's admin), has nothing to masquerade it: it
	// would leave with the sandbox's own address, uncounted.
	add(ctState(expr.CtStateBitINVALID|expr.CtStateBitUNTRACKED), drop)
	// Its own connections' packets; a packet of, or related to, any other
	// tracked connection (an ICMP error naming another sandbox's flow) is
	// dropped whatever the policy: it would leave under that connection's
	// NAT, as that connection's.
	rs = append(rs, ownConnAccept()...)
	add(ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), drop)
	// A new connection past the sandbox's tracked ones (maxFlows), counted
	// by its source address, or past its rate of new ones: refused. Its
	// TCP connections, once closed, leave the table soon (ctClosed).
	add(ctState(expr.CtStateBitNEW), newPastRate(), refused)
	add(ctState(expr.CtStateBitNEW), pastFlows(), refused)
	add(ctState(expr.CtStateBitNEW), closedSoon())
	// DNS and DNS over TLS/QUIC to anyone but the gateway (which dstnat
	// has redirected to the resolver before this): denied.
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		for _, port := range []uint16{53, 853} {
			denyLogged(l4proto(proto), dport(port))
		}
	}
	denyLogged(profileLookup())
	allowLogged(idLookup(setAllow, false))
	for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
		allowLogged(l4proto(proto), idLookup(setAllowP, true))
	}
	allowLogged(idLookup(setNames, false))
	for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
		allowLogged(l4proto(proto), idLookup(setNamesP, true))
	}
	// Internet mode's deny list (only internet sandboxes have elements
	// there): an allow entry, above, still wins.
	denyLogged(idLookup(setDeny, false))
	for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
		denyLogged(l4proto(proto), idLookup(setDenyP, true))
	}
	denyLogged(idLookup(setDNames, false))
	allowLogged(loadID(), []expr.Any{&expr.Lookup{SourceRegister: r0, SetName: setInternet}})
	denyLogged()
	return rs
}

// toHostRules is the tohost chain: to the host itself, only DNS that the
// owner's redirect sent to its resolver (the gateway's port 53 rewritten
// to the resolver's port, as dnsin has it for the sandbox), at most
// dnsPackets a second per sandbox and protocol (the rest is dropped here,
// so that a flood costs the resolver nothing), and replies; then a logged
// refusal. Nothing passes whose interface and source address are not one
// sandbox's. A connection some other table redirected to the host is refused
// like any other.
func toHostRules() [][]expr.Any {
	// From a sandbox's own interface and address only, before anything is
	// accepted: a packet from another's address (which a sandbox's code
	// cannot send, but a compromised guest kernel could) never rides that
	// sandbox's established flow to the resolver, nor any flow of the
	// host's own.
	rs := [][]expr.Any{cat(notSandbox(), verdict(expr.VerdictDrop))}
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		ours := cat(l4proto(proto), ctStatus(ipsDstNAT), ctOrigDport(53), idLookup(setDNSIn, true))
		flood := []expr.Any{
			load(r6, expr.PayloadBaseNetworkHeader, 12, 4),
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: r7},
			&expr.Dynset{SrcRegKey: r6, SetName: setDNSLim, Operation: unix.NFT_DYNSET_OP_UPDATE, Timeout: meterTimeout,
				Exprs: []expr.Any{&expr.Limit{Type: expr.LimitTypePkts, Rate: dnsPackets, Unit: expr.LimitTimeSecond, Burst: dnsBurst, Over: true}}},
		}
		// Its connections to the resolver count among its tracked ones
		// (a UDP question is one for 30 s, a closed TCP one for
		// closedTimeout).
		rs = append(rs, cat(ours, flood, verdict(expr.VerdictDrop)),
			cat(ours, ctState(expr.CtStateBitNEW), pastFlows(), verdict(expr.VerdictDrop)),
			cat(ours, ctState(expr.CtStateBitNEW), closedSoon()),
			cat(ours, verdict(expr.VerdictAccept)))
	}
	// Replies and ICMP errors of the sandbox's own connections only: an
	// ICMP error naming one of the host's connections (its resolver's
	// questions upstream) is refused.
	rs = append(rs, ownConnAccept()...)
	return append(rs, logTo(setLogD), reject())
}

// dnatRules are dstnat's: DNS to the gateway, from a sandbox, goes to its
// owner's resolver.
func dnatRules() [][]expr.Any {
	var rs [][]expr.Any
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		rs = append(rs, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), nfproto(unix.NFPROTO_IPV4, true), l4proto(proto), dport(53),
			loadID(), []expr.Any{
				load(r4, expr.PayloadBaseNetworkHeader, 16, 4),
				&expr.Lookup{SourceRegister: r0, SetName: setDNAT, DestRegister: r6, IsDestRegSet: true},
				&expr.Redir{RegisterProtoMin: r6, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
			}))
	}
	return rs
}

// logRules is an owner's log chain for a decision: the packet (a new
// connection: established ones were accepted before) to the owner's log
// group, at most 20 a second per sandbox (the meter, by source address).
func logRules(meter string, group uint16, decision string) []expr.Any {
	return []expr.Any{
		load(r0, expr.PayloadBaseNetworkHeader, 12, 4),
		&expr.Dynset{SrcRegKey: r0, SetName: meter, Operation: unix.NFT_DYNSET_OP_UPDATE, Timeout: meterTimeout,
			Exprs: []expr.Any{&expr.Limit{Type: expr.LimitTypePkts, Rate: 20, Unit: expr.LimitTimeSecond, Burst: 40}}},
		&expr.Log{Key: 1<<unix.NFTA_LOG_GROUP | 1<<unix.NFTA_LOG_PREFIX, Group: group, Data: []byte(logPrefix + decision)},
	}
}

// logPrefix begins every log record's prefix ("cage a", "cage d").
const logPrefix = "cage "

// Names of an owner's log chains.
func logChains(group uint16) (allow, deny string) {
	return fmt.Sprintf("la%d", group), fmt.Sprintf("ld%d", group)
}

// ipsDstNAT is IPS_DST_NAT of a conntrack entry's status (linux/netfilter/nf_conntrack_common.h).
const ipsDstNAT = 1 << 5
