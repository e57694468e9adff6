package network

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The base of the shared table: chains hooked into the kernel, the shared
// sets and chains (see nft.go), and two regular chains besides:
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

// ensureBase creates the table, its sets and chains, or rewrites the rules
// of existing chains (every cage process writes the same base rules, in
// one batch the kernel applies atomically, so an older process's table is
// brought up to date), and this process's log chains for its log group.
// A table of the older layout (per-sandbox chains and sets, reached
// through the verdict maps fwd, inp and dns) is converted in the same
// batch: its objects are deleted, so that its base rules, which dropped
// every cage* interface they had no chain for, cannot drop the new
// sandboxes' traffic; the sandboxes of the older process that made them
// lose their network until a process adopts them (see docs/SECURITY.md).
// turnedOn says this process has just turned IPv4 forwarding on. The
// caller holds the host-wide network lock.
func (n *nft) ensureBase(turnedOn bool, group uint16, denied []span) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.group = group
	c := n.conn
	exists := false
	if t, err := c.ListTableOfFamily(tableName, nftables.TableFamilyINet); err == nil && t != nil {
		exists = true
	}
	guardExists := false
	var old []func()
	if exists {
		if _, err := c.ListChain(n.table, guardChain); err == nil {
			guardExists = true
		}
		n.gcOwners(group)
		var err error
		if old, err = n.oldLayout(); err != nil {
			return fmt.Errorf("nftables: table %s: %w", tableName, err)
		}
	}
	c.AddTable(n.table)
	base, regular := n.addChains(group)
	if exists {
		for _, ch := range base {
			c.FlushChain(ch)
		}
		for _, del := range old {
			del()
		}
		for _, ch := range regular {
			c.FlushChain(ch)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(n.sets)) {
		if err := c.AddSet(n.sets[name], nil); err != nil {
			return err
		}
	}
	n.addClosedTimeout()
	guard := guardExists
	if turnedOn && !guardExists {
		g := c.AddChain(&nftables.Chain{Name: guardChain, Table: n.table})
		c.AddRule(&nftables.Rule{Table: n.table, Chain: g, Exprs: verdict(expr.VerdictDrop)})
		guard = true
	}
	n.baseRules(base, regular, guard)
	if err := n.ownerElements(group, denied); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: create table %s: %w", tableName, err)
	}
	return nil
}

// addClosedTimeout queues the ct timeout object ctClosed (an existing
// one is left as it is: the kernel cannot update it). The library fills in
// the kernel's defaults for the states not named (the caller holds mu).
func (n *nft) addClosedTimeout() {
	n.conn.AddObj(&nftables.NamedObj{Table: n.table, Name: ctClosed, Type: nftables.ObjTypeCtTimeout,
		Obj: &expr.CtTimeout{L3Proto: unix.NFPROTO_IPV4, L4Proto: unix.IPPROTO_TCP, Policy: expr.CtStatePolicyTimeout{
			expr.CtStateTCPTIMEWAIT: closedTimeout,
			expr.CtStateTCPCLOSE:    closedTimeout,
		}}})
}

// addChains queues the base chains (early, forward, input, output, dstnat, srcnat) and
// the regular ones, the owner's log chains included (the caller holds mu).
func (n *nft) addChains(group uint16) (base, regular map[string]*nftables.Chain) {
	c := n.conn
	accept := nftables.ChainPolicyAccept
	base = map[string]*nftables.Chain{}
	for _, b := range []struct {
		name string
		typ  nftables.ChainType
		hook *nftables.ChainHook
		prio *nftables.ChainPriority
	}{
		{earlyChain, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityRef(earlyPriority)},
		{"forward", nftables.ChainTypeFilter, nftables.ChainHookForward, nftables.ChainPriorityFilter},
		{"input", nftables.ChainTypeFilter, nftables.ChainHookInput, nftables.ChainPriorityFilter},
		{"output", nftables.ChainTypeFilter, nftables.ChainHookOutput, nftables.ChainPriorityFilter},
		{"dstnat", nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest},
		{"srcnat", nftables.ChainTypeNAT, nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource},
	} {
		base[b.name] = c.AddChain(&nftables.Chain{Name: b.name, Table: n.table, Type: b.typ, Hooknum: b.hook, Priority: b.prio, Policy: &accept})
	}
	la, ld := logChains(group)
	regular = map[string]*nftables.Chain{}
	for _, name := range []string{refuseChain, fromChain, toHostChain, la, ld} {
		regular[name] = c.AddChain(&nftables.Chain{Name: name, Table: n.table})
	}
	return base, regular
}

// ownerElements queues the owner's entries in the log maps and its
// profile's denied ranges (the caller holds mu).
func (n *nft) ownerElements(group uint16, denied []span) error {
	c := n.conn
	la, ld := logChains(group)
	key := binary.BigEndian.AppendUint32(nil, uint32(group))
	for m, chain := range map[string]string{setLogA: la, setLogD: ld} {
		if err := c.SetAddElements(n.sets[m], []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: chain}}}); err != nil {
			return err
		}
	}
	return c.SetAddElements(n.sets[setXDeny], profileElements(profileOf(denied), denied))
}

// oldLayout lists the deletions that convert a table of the older layout
// (nil when it has none of it): the verdict maps, the per-sandbox chains
// s<slot>, i<slot>, d<slot> and sets x, n, p, y<slot>. They are queued
// after the base chains are flushed (which drops the maps' last users).
func (n *nft) oldLayout() ([]func(), error) {
	c := n.conn
	sets, err := c.GetSets(n.table)
	if err != nil {
		return nil, err
	}
	var out []func()
	for _, s := range sets {
		if s.Name == "fwd" || s.Name == "inp" || s.Name == "dns" {
			out = append(out, func() { c.DelSet(s) })
		}
	}
	if len(out) == 0 {
		return nil, nil // the current layout
	}
	for _, s := range sets {
		if perSlot(s.Name, "xnpy") {
			out = append(out, func() { c.DelSet(s) })
		}
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, err
	}
	for _, ch := range chains {
		if ch.Table.Name == tableName && perSlot(ch.Name, "sid") {
			out = append(out, func() { c.FlushChain(ch); c.DelChain(ch) })
		}
	}
	return out, nil
}

// perSlot reports whether name is one of the letters followed by a number.
func perSlot(name, letters string) bool {
	if len(name) < 2 || !strings.ContainsRune(letters, rune(name[0])) {
		return false
	}
	_, err := strconv.Atoi(name[1:])
	return err == nil
}

// gcOwners removes the log chains of processes that are gone: a log
// group nobody has bound (this process can bind it) has no owner. Its
// sandboxes, if any are left, are then not logged until adopted (their
// decisions do not depend on it). The caller holds mu.
func (n *nft) gcOwners(own uint16) {
	c := n.conn
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return
	}
	for _, ch := range chains {
		if ch.Table.Name != tableName || !strings.HasPrefix(ch.Name, "la") {
			continue
		}
		g, err := strconv.ParseUint(ch.Name[2:], 10, 16)
		if err != nil || uint16(g) == own || !groupFree(uint16(g)) {
			continue
		}
		n.dropOwner(uint16(g))
	}
}

// dropOwner removes a log group's chains and its elements of the log maps
// (the caller holds mu).
func (n *nft) dropOwner(group uint16) {
	c := n.conn
	key := []nftables.SetElement{{Key: binary.BigEndian.AppendUint32(nil, uint32(group))}}
	la, ld := logChains(group)
	_ = c.SetDeleteElements(n.sets[setLogA], key)
	_ = c.SetDeleteElements(n.sets[setLogD], key)
	for _, name := range []string{la, ld} {
		ch := &nftables.Chain{Name: name, Table: n.table}
		c.FlushChain(ch)
		c.DelChain(ch)
	}
	_ = c.Flush()
}

// closeOwner removes this process's log chains (its sandboxes keep their
// elements and rules: a process that adopts them logs them).
func (n *nft) closeOwner() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.group != 0 {
		n.dropOwner(n.group)
	}
}

// baseRules queues the rules of the base chains and the shared regular
// chains (the caller holds mu and flushes).
func (n *nft) baseRules(base, regular map[string]*nftables.Chain, guard bool) {
	c := n.conn
	rule := func(ch *nftables.Chain, e ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: e})
	}
	fwd, in, dnat, snat := base["forward"], base["input"], base["dstnat"], base["srcnat"]
	// early: a sandbox's IPv4 fragments are dropped as they come in,
	// before the host reassembles them. Reassembly (which connection
	// tracking needs, and so every rule after it) queues fragments in the
	// host's network namespace, in queues shared by the host and every
	// sandbox and bounded as a whole (net.ipv4.ipfrag_high_thresh, 4 MiB,
	// each queue kept ipfrag_time, 30 s): a sandbox that sent first
	// fragments whose rest never came (root in a microVM's guest; even
	// one with an empty allowlist, whose packets no rule had seen yet)
	// filled them, and every fragment that came after was dropped, the
	// host's own and other sandboxes' large datagrams from the outside
	// (found by review, 2026-12-05). A sandbox's TCP and QUIC never
	// fragment (they send within the path's MTU); a UDP datagram larger
	// than its link's MTU does not leave it.
	early := base[earlyChain]
	rule(early, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), nfproto(unix.NFPROTO_IPV4, true), []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 6, Len: 2},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 2, Mask: []byte{0x3f, 0xff}, Xor: []byte{0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0}},
	}, verdict(expr.VerdictDrop))...)
	// And so is a packet with IP options (a header longer than 20
	// bytes): the kernel hands a forwarded packet with the Router Alert
	// option to the host's sockets that asked for them
	// (IP_ROUTER_ALERT: multicast routing and IGMP proxy daemons, RSVP)
	// before the forward hook, so no rule of cage's saw it. A sandbox's
	// plain UDP socket can set the option (IP_OPTIONS), and found by
	// review, 2026-12-05, one with an empty allowlist reached such a
	// socket of the host's. Nothing a sandbox runs needs IP options.
	rule(early, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), nfproto(unix.NFPROTO_IPV4, true), []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 0, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x0f}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{5}},
	}, verdict(expr.VerdictDrop))...)
	goTo := func(chain string) []expr.Any { return []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: chain}} }
	// forward: the fromsbx chain decides what leaves a sandbox.
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), goTo(fromChain))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), verdict(expr.VerdictDrop))...)
	if guard {
		rule(fwd, &expr.Verdict{Kind: expr.VerdictJump, Chain: guardChain})
	}
	for _, r := range fromSandboxRules() {
		rule(regular[fromChain], r...)
	}
	// input: the host itself answers a sandbox only through its resolver
	// (every packet goes to tohost, replies included: it bounds the
	// sandbox's DNS packets).
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), goTo(toHostChain))...)
	for _, r := range toHostRules() {
		rule(regular[toHostChain], r...)
	}
	// output: the host's other users reach no sandbox. What the host
	// sends a sandbox is its answers (DNS replies, ICMP errors) and what
	// root sends; a connection a host user's process opens to a sandbox's
	// address is dropped: a sandbox's servers are reached through the
	// proxy, with its credentials. (Found by review, 2026-12-03: any host
	// user's curl reached a sandbox's server at its address, past the
	// traffic token and the audit trail.) A packet of no socket (the
	// kernel's own) has no owner to match and passes.
	out := base["output"]
	rule(out, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(out, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), []expr.Any{
		&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}},
	}, verdict(expr.VerdictDrop))...)
	// dstnat: DNS to the gateway goes to the owner's resolver.
	for _, r := range dnatRules() {
		rule(dnat, r...)
	}
	// srcnat: what leaves for elsewhere takes the host's address.
	rule(snat, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ifnamePrefix(expr.MetaKeyOIFNAME, false), []expr.Any{&expr.Masq{}})...)
	// refuse: a reset for a TCP segment that is not a connection attempt,
	// ICMP for everything else.
	rule(regular[refuseChain], cat(l4proto(unix.IPPROTO_TCP), tcpFlagsNot(tcpSYN), []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}})...)
	rule(regular[refuseChain], reject()...)
	la, ld := logChains(n.group)
	rule(regular[la], logRules(setLimA, n.group, logAllow)...)
	rule(regular[ld], logRules(setLimD, n.group, logDeny)...)
}

// The base chain that drops what no rule may see of a sandbox's (its
// fragments, its packets with IP options), and its priority: before the
// kernel's defragmentation (-400), which queues fragments.
const (
	earlyChain    = "early"
	earlyPriority = -450
)

// Names of the shared regular chains.
const (
	refuseChain = "refuse"
	guardChain  = "guard"
	fromChain   = "fromsbx"
	toHostChain = "tohost"
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
