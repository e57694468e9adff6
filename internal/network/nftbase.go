package network

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The base of the shared table: chains hooked into the kernel, the verdict
// maps that send each sandbox's packets to its own chains, and two regular
// chains every sandbox shares:
//
//	refuse: how a denied packet is refused. A connection attempt (a TCP SYN,
//	        any other protocol) gets ICMP "administratively prohibited", so a
//	        program fails at once; a TCP segment of a connection the sandbox
//	        had before a policy change cut it gets a TCP reset, so the
//	        program sees the connection end instead of retrying for minutes.
//	guard:  exists only where cage turned IPv4 forwarding on (the host did
//	        not route before): the forward chain ends by jumping to it, and
//	        it drops what is forwarded between interfaces that are not
//	        cage's, so that cage does not make the host a router. Where
//	        forwarding was on already, the host's admin routes on purpose and
//	        cage adds nothing. An admin who later wants the host to route for
//	        something else lifts it with `nft flush chain inet cage guard`;
//	        cage never writes into an existing guard chain.

// ensureBase creates the table and its base chains, or rewrites the rules
// of existing ones (every cage process writes the same base rules, in one
// batch the kernel applies atomically, so an older process's table is
// brought up to date). turnedOn says this process has just turned IPv4
// forwarding on. The caller holds the host-wide network lock.
func (n *nft) ensureBase(turnedOn bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.conn
	exists := false
	if t, err := c.ListTableOfFamily(tableName, nftables.TableFamilyINet); err == nil && t != nil {
		exists = true
	}
	guardExists := false
	if exists {
		if _, err := c.ListChain(n.table, guardChain); err == nil {
			guardExists = true
		}
	}
	c.AddTable(n.table)
	for _, m := range []*nftables.Set{n.fwd, n.inp, n.dns} {
		if err := c.AddSet(m, nil); err != nil {
			return err
		}
	}
	accept := nftables.ChainPolicyAccept
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: n.table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: n.table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	dnat := c.AddChain(&nftables.Chain{Name: "dstnat", Table: n.table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest, Policy: &accept})
	snat := c.AddChain(&nftables.Chain{Name: "srcnat", Table: n.table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept})
	refuseCh := c.AddChain(&nftables.Chain{Name: refuseChain, Table: n.table})
	if exists {
		for _, ch := range []*nftables.Chain{fwd, in, dnat, snat, refuseCh} {
			c.FlushChain(ch)
		}
	}
	guard := guardExists
	if turnedOn && !guardExists {
		g := c.AddChain(&nftables.Chain{Name: guardChain, Table: n.table})
		c.AddRule(&nftables.Rule{Table: n.table, Chain: g, Exprs: verdict(expr.VerdictDrop)})
		guard = true
	}
	n.baseRules(fwd, in, dnat, snat, refuseCh, guard)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: create table %s: %w", tableName, err)
	}
	return nil
}

// baseRules queues the rules of the base chains and the refuse chain (the
// caller holds mu and flushes).
func (n *nft) baseRules(fwd, in, dnat, snat, refuseCh *nftables.Chain, guard bool) {
	c := n.conn
	rule := func(ch *nftables.Chain, e ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: e})
	}
	// forward: each sandbox's own chain decides what leaves it.
	rule(fwd, cat(ifname(expr.MetaKeyIIFNAME), vmap("fwd"))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), verdict(expr.VerdictDrop))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), verdict(expr.VerdictDrop))...)
	if guard {
		rule(fwd, &expr.Verdict{Kind: expr.VerdictJump, Chain: guardChain})
	}
	// input: the host itself answers a sandbox only through its resolver,
	// which the sandbox's own chain i<slot> accepts (every packet goes
	// there, replies included: it bounds the sandbox's DNS packets).
	rule(in, cat(ifname(expr.MetaKeyIIFNAME), vmap("inp"))...)
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), reject())...)
	// dstnat: DNS to the gateway goes to the owner's resolver.
	rule(dnat, cat(ifname(expr.MetaKeyIIFNAME), vmap("dns"))...)
	// srcnat: what leaves for elsewhere takes the host's address.
	rule(snat, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ifnamePrefix(expr.MetaKeyOIFNAME, false), []expr.Any{&expr.Masq{}})...)
	// refuse: a reset for a TCP segment that is not a connection attempt,
	// ICMP for everything else.
	rule(refuseCh, cat(l4proto(unix.IPPROTO_TCP), tcpFlagsNot(tcpSYN), []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}})...)
	rule(refuseCh, reject()...)
}

// Names of the shared regular chains.
const (
	refuseChain = "refuse"
	guardChain  = "guard"
)

// forwardGuarded reports whether the table drops forwarding that is not a
// sandbox's (for cage doctor; false when there is no table).
func (n *nft) forwardGuarded() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, err := n.conn.ListChain(n.table, guardChain)
	return err == nil
}

// TCP flags (the segment's 14th byte) a connection attempt is told by.
const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

// tcpFlagsNot matches a TCP segment whose FIN, SYN, RST and ACK flags are
// not exactly want.
func tcpFlagsNot(want byte) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{tcpFIN | tcpSYN | tcpRST | tcpACK}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{want}},
	}
}

// refuse sends a denied packet to the shared refuse chain.
func refuse() []expr.Any {
	return []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: refuseChain}}
}

// ctOrigDport matches the destination port the connection was first sent
// to (before any NAT).
func ctOrigDport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeyPROTODST, Direction: 0},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(p >> 8), byte(p)}},
	}
}
