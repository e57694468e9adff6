package network

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// cage's rules live in one nftables table of its own, "inet cage", shared by
// every cage process on the host (a daemon and any number of `cage run`);
// each process adds and removes only its own sandboxes' objects and never
// flushes the table. Base chains dispatch on the input interface through two
// verdict maps to per-sandbox chains:
//
//	forward (filter):   iifname vmap @fwd  -> chain s<slot>: the policy
//	                    other cage* input  -> drop; to cage*: only replies
//	input (filter):     from cage*: replies and DNS redirected to a resolver;
//	                    else iifname vmap @inp -> chain i<slot>: logged refusal
//	dstnat (nat):       iifname vmap @dns  -> chain d<slot>: DNS to the gateway -> resolver
//	srcnat (nat):       from cage* out elsewhere -> masquerade
//
// Per sandbox: chains s<slot>, i<slot> and d<slot>, set x<slot> (its denied ranges),
// set n<slot> (addresses its allowed names resolved to, until their TTL) and
// set p<slot> (the same with a port).
const (
	tableName = "cage"
	ifPrefix  = "cage" // host-side interface names: cage<slot>
)

// Policy decisions in the log prefix the records reader parses.
const (
	logAllow = "a"
	logDeny  = "d"
)

type nft struct {
	mu    sync.Mutex
	conn  *nftables.Conn
	table *nftables.Table
	fwd   *nftables.Set
	inp   *nftables.Set
	dns   *nftables.Set
}

func newNFT() (*nft, error) {
	conn, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	n := &nft{conn: conn, table: &nftables.Table{Name: tableName, Family: nftables.TableFamilyINet}}
	n.fwd = &nftables.Set{Table: n.table, Name: "fwd", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	n.inp = &nftables.Set{Table: n.table, Name: "inp", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	n.dns = &nftables.Set{Table: n.table, Name: "dns", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	return n, nil
}

func (n *nft) close() { _ = n.conn.CloseLasting() }

// ensureBase creates the table and its base chains unless they exist. The
// caller holds the host-wide network lock.
func (n *nft) ensureBase() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if t, err := n.conn.ListTableOfFamily(tableName, nftables.TableFamilyINet); err == nil && t != nil {
		if _, err := n.conn.ListChain(n.table, "forward"); err == nil {
			return nil
		}
	}
	c := n.conn
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

	rule := func(ch *nftables.Chain, e ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: ch, Exprs: e})
	}
	// forward: each sandbox's own chain decides what leaves it.
	rule(fwd, cat(ifname(expr.MetaKeyIIFNAME), vmap("fwd"))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), verdict(expr.VerdictDrop))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(fwd, cat(ifnamePrefix(expr.MetaKeyOIFNAME, true), verdict(expr.VerdictDrop))...)
	// input: the host itself answers a sandbox only through its resolver.
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))...)
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ctStatus(ipsDstNAT), verdict(expr.VerdictAccept))...)
	rule(in, cat(ifname(expr.MetaKeyIIFNAME), vmap("inp"))...)
	rule(in, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), reject())...)
	// dstnat: DNS to the gateway goes to the owner's resolver.
	rule(dnat, cat(ifname(expr.MetaKeyIIFNAME), vmap("dns"))...)
	// srcnat: what leaves for elsewhere takes the host's address.
	rule(snat, cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), ifnamePrefix(expr.MetaKeyOIFNAME, false), []expr.Any{&expr.Masq{}})...)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: create table %s: %w", tableName, err)
	}
	return nil
}

// sandboxRules is what the per-sandbox objects are made from.
type sandboxRules struct {
	slot     int
	ip       netip.Addr // the sandbox's address
	gateway  netip.Addr
	policy   Policy
	denied   []span // always-denied ranges for this host's configuration
	resolver uint16 // the owner's resolver port
	group    uint16 // the owner's log group
}

func (s *sandboxRules) ifname() string { return ifName(s.slot) }

func ifName(slot int) string { return ifPrefix + strconv.Itoa(slot) }

func (n *nft) names(slot int) (filter, input, nat, deny, names, ports string) {
	v := strconv.Itoa(slot)
	return "s" + v, "i" + v, "d" + v, "x" + v, "n" + v, "p" + v
}

func (n *nft) sets(slot int) (deny, names, ports *nftables.Set) {
	_, _, _, x, nm, p := n.names(slot)
	deny = &nftables.Set{Table: n.table, Name: x, KeyType: nftables.TypeIPAddr, Interval: true}
	names = &nftables.Set{Table: n.table, Name: nm, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	ports = &nftables.Set{Table: n.table, Name: p, KeyType: nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetService),
		HasTimeout: true, Concatenation: true}
	return
}

// add creates a sandbox's objects, or replaces its rules if they exist (a
// policy change, or an adopting process with its own resolver and log
// group). Learned addresses are kept.
func (n *nft) add(s *sandboxRules, replace bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.conn
	fname, iname, nname, _, _, _ := n.names(s.slot)
	filter := &nftables.Chain{Name: fname, Table: n.table}
	input := &nftables.Chain{Name: iname, Table: n.table}
	nat := &nftables.Chain{Name: nname, Table: n.table}
	deny, names, ports := n.sets(s.slot)
	if replace {
		for _, ch := range []*nftables.Chain{filter, input, nat} {
			c.FlushChain(ch)
		}
		c.FlushSet(deny)
	} else {
		for _, ch := range []*nftables.Chain{filter, input, nat} {
			c.AddChain(ch)
		}
		for _, set := range []*nftables.Set{deny, names, ports} {
			if err := c.AddSet(set, nil); err != nil {
				return err
			}
		}
	}
	if err := c.SetAddElements(deny, intervalElements(s.denied)); err != nil {
		return err
	}
	for _, r := range policyRules(s, deny.Name, names.Name, ports.Name) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: filter, Exprs: r})
	}
	// To the host itself, only replies and DNS to the resolver (accepted in
	// the base chain) pass.
	c.AddRule(&nftables.Rule{Table: n.table, Chain: input, Exprs: cat(s.log(logDeny), reject())})
	c.AddRule(&nftables.Rule{Table: n.table, Chain: input, Exprs: reject()})
	// DNS to the gateway, from the sandbox's own address, goes to this
	// process's resolver.
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: nat, Exprs: cat(
			nfproto(unix.NFPROTO_IPV4, true), ipField(12, s.ip), ipField(16, s.gateway), l4proto(proto), dport(53),
			[]expr.Any{
				&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(s.resolver)},
				&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
			})})
	}
	if !replace {
		key := ifKey(s.ifname())
		for _, m := range []struct {
			set   *nftables.Set
			chain string
		}{{n.fwd, fname}, {n.inp, iname}, {n.dns, nname}} {
			if err := c.SetAddElements(m.set, []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: m.chain}}}); err != nil {
				return err
			}
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables: rules of sandbox slot %d: %w", s.slot, err)
	}
	return nil
}

// remove deletes a sandbox's objects. Missing ones are not an error (a
// half-made sandbox, or GC after its owner removed some).
func (n *nft) remove(slot int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.conn
	key := ifKey(ifName(slot))
	fname, iname, nname, _, _, _ := n.names(slot)
	deny, names, ports := n.sets(slot)
	// Each step is its own batch: a batch fails whole on the first missing object.
	var steps []func()
	for _, m := range []*nftables.Set{n.fwd, n.inp, n.dns} {
		steps = append(steps, func() { _ = c.SetDeleteElements(m, []nftables.SetElement{{Key: key}}) })
	}
	for _, name := range []string{fname, iname, nname} {
		ch := &nftables.Chain{Name: name, Table: n.table}
		steps = append(steps, func() { c.FlushChain(ch) }, func() { c.DelChain(ch) })
	}
	for _, set := range []*nftables.Set{deny, names, ports} {
		steps = append(steps, func() { c.DelSet(set) })
	}
	var first error
	for _, step := range steps {
		step()
		if err := c.Flush(); err != nil && !isNotFound(err) && first == nil {
			first = err
		}
	}
	return first
}

func isNotFound(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "no such file") || strings.Contains(err.Error(), "ENOENT"))
}

// learn adds addresses a name resolved to, for ttl.
func (n *nft) learn(slot int, addrs []netip.Addr, ports []uint16, ttl time.Duration) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, names, portSet := n.sets(slot)
	var any, withPort []nftables.SetElement
	for _, a := range addrs {
		b := a.As4()
		for _, p := range ports {
			if p == 0 {
				any = append(any, nftables.SetElement{Key: b[:], Timeout: ttl})
			} else {
				withPort = append(withPort, nftables.SetElement{Key: append(b[:], binaryutil.BigEndian.PutUint16(p)[0], binaryutil.BigEndian.PutUint16(p)[1], 0, 0), Timeout: ttl})
			}
		}
	}
	if len(any) > 0 {
		if err := n.conn.SetAddElements(names, any); err != nil {
			return err
		}
	}
	if len(withPort) > 0 {
		if err := n.conn.SetAddElements(portSet, withPort); err != nil {
			return err
		}
	}
	return n.conn.Flush()
}

// forget empties a sandbox's learned addresses (its policy changed).
func (n *nft) forget(slot int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, names, ports := n.sets(slot)
	n.conn.FlushSet(names)
	n.conn.FlushSet(ports)
	return n.conn.Flush()
}

// slots lists the sandbox slots that have objects in the table.
func (n *nft) slots() ([]int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	chains, err := n.conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, ch := range chains {
		if ch.Table.Name != tableName || !strings.HasPrefix(ch.Name, "s") {
			continue
		}
		if v, err := strconv.Atoi(ch.Name[1:]); err == nil {
			out = append(out, v)
		}
	}
	return out, nil
}

// policyRules is a sandbox's filter chain.
func policyRules(s *sandboxRules, deny, names, ports string) [][]expr.Any {
	var rs [][]expr.Any
	add := func(e ...[]expr.Any) { rs = append(rs, cat(e...)) }
	accept, drop, refuse := verdict(expr.VerdictAccept), verdict(expr.VerdictDrop), reject()
	allowLogged := func(match ...[]expr.Any) {
		add(append(match, s.log(logAllow), accept)...)
		add(append(match, accept)...)
	}
	// Denied connections are refused at once (ICMP "administratively
	// prohibited"): a program inside fails fast instead of timing out.
	denyLogged := func(match ...[]expr.Any) {
		add(append(match, s.log(logDeny), refuse)...)
		add(append(match, refuse)...)
	}
	// IPv4 only, from the sandbox's own address only.
	add(nfproto(unix.NFPROTO_IPV4, false), drop)
	add(ipFieldNeq(12, s.ip), drop)
	add(ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), accept)
	// DNS and DNS over TLS/QUIC to anyone but the gateway (which the nat
	// chain has redirected to the resolver before this): denied.
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		for _, port := range []uint16{53, 853} {
			denyLogged(l4proto(proto), dport(port))
		}
	}
	denyLogged(lookup(16, deny, false))
	for _, r := range s.policy.Allow {
		if r.Name == "" {
			for _, m := range prefixMatch(r) {
				allowLogged(m...)
			}
		}
	}
	allowLogged(lookup(16, names, false))
	allowLogged(portLookup(unix.IPPROTO_TCP, ports))
	allowLogged(portLookup(unix.IPPROTO_UDP, ports))
	if s.policy.Mode == Internet {
		for _, r := range s.policy.Deny {
			if r.Name == "" {
				for _, m := range prefixMatch(r) {
					denyLogged(m...)
				}
			}
		}
		add(s.log(logAllow), accept)
		add(accept)
		return rs
	}
	add(s.log(logDeny), refuse)
	add(refuse)
	return rs
}

// prefixMatch matches a range rule's destination (and port, for TCP and UDP).
func prefixMatch(r Rule) [][][]expr.Any {
	m := daddrIn(r.Prefix)
	if r.Port == 0 {
		return [][][]expr.Any{{m}}
	}
	return [][][]expr.Any{
		{m, l4proto(unix.IPPROTO_TCP), dport(r.Port)},
		{m, l4proto(unix.IPPROTO_UDP), dport(r.Port)},
	}
}

// log records the packet (a new connection: established ones were accepted
// before) to the owner's log group, at most 20 a second per rule.
func (s *sandboxRules) log(decision string) []expr.Any {
	return []expr.Any{
		&expr.Limit{Type: expr.LimitTypePkts, Rate: 20, Unit: expr.LimitTimeSecond, Burst: 40},
		&expr.Log{Key: 1<<unix.NFTA_LOG_GROUP | 1<<unix.NFTA_LOG_PREFIX, Group: s.group,
			Data: []byte(fmt.Sprintf("cage %d %s", s.slot, decision))},
	}
}

// Expression helpers: each returns the expressions of one match.

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func verdict(k expr.VerdictKind) []expr.Any { return []expr.Any{&expr.Verdict{Kind: k}} }

// reject refuses with ICMP "administratively prohibited" (a TCP connect
// fails with EHOSTUNREACH at once).
func reject() []expr.Any {
	return []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}}
}

func ifKey(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

func ifname(key expr.MetaKey) []expr.Any { return []expr.Any{&expr.Meta{Key: key, Register: 1}} }

func vmap(set string) []expr.Any {
	return []expr.Any{&expr.Lookup{SourceRegister: 1, DestRegister: 0, IsDestRegSet: true, SetName: set}}
}

// ifnamePrefix matches interfaces named cage* (eq) or not (!eq).
func ifnamePrefix(key expr.MetaKey, eq bool) []expr.Any {
	op := expr.CmpOpEq
	if !eq {
		op = expr.CmpOpNeq
	}
	return []expr.Any{&expr.Meta{Key: key, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: []byte(ifPrefix)}}
}

func nfproto(p byte, eq bool) []expr.Any {
	op := expr.CmpOpNeq
	if eq {
		op = expr.CmpOpEq
	}
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: []byte{p}}}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}}}
}

func dport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

// ipField matches the IPv4 header's address at offset (12 source, 16 destination).
func ipField(offset uint32, a netip.Addr) []expr.Any {
	b := a.As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: b[:]},
	}
}

func ipFieldNeq(offset uint32, a netip.Addr) []expr.Any {
	e := ipField(offset, a)
	e[1].(*expr.Cmp).Op = expr.CmpOpNeq
	return e
}

func daddrIn(p netip.Prefix) []expr.Any {
	if p.Bits() == 32 {
		return ipField(16, p.Addr())
	}
	net := p.Masked().Addr().As4()
	mask := make([]byte, 4)
	for i := 0; i < p.Bits(); i++ {
		mask[i/8] |= 0x80 >> (i % 8)
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: net[:]},
	}
}

func lookup(offset uint32, set string, invert bool) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: set, Invert: invert},
	}
}

// portLookup matches "ip daddr . th dport" of proto (TCP or UDP) in set.
func portLookup(proto byte, set string) []expr.Any {
	return cat(l4proto(proto), []expr.Any{
		&expr.Payload{DestRegister: unix.NFT_REG32_00, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Payload{DestRegister: unix.NFT_REG32_01, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: unix.NFT_REG32_00, SetName: set},
	})
}

func ctState(mask uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}},
	}
}

func ctStatus(mask uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATUS},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(mask), Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0, 0, 0}},
	}
}

// intervalElements are an interval set's elements for spans.
func intervalElements(spans []span) []nftables.SetElement {
	var els []nftables.SetElement
	if len(spans) > 0 && spans[0].lo != 0 {
		els = append(els, nftables.SetElement{Key: []byte{0, 0, 0, 0}, IntervalEnd: true})
	}
	for _, s := range spans {
		lo := addr(s.lo).As4()
		els = append(els, nftables.SetElement{Key: lo[:]})
		if s.hi != ^uint32(0) {
			hi := addr(s.hi + 1).As4()
			els = append(els, nftables.SetElement{Key: hi[:], IntervalEnd: true})
		}
	}
	return els
}

// ipsDstNAT is IPS_DST_NAT of a conntrack entry's status (linux/netfilter/nf_conntrack_common.h).
const ipsDstNAT = 1 << 5
