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
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// cage's rules live in one nftables table of its own, "inet cage", shared by
// every cage process on the host (a daemon and any number of `cage run`);
// each process adds and removes only its own sandboxes' objects and never
// flushes the table. Base chains dispatch on the input interface through
// verdict maps to per-sandbox chains (see nftbase.go for the base):
//
//	forward (filter):   iifname vmap @fwd  -> chain s<slot>: the policy
//	                    other cage* input  -> drop; to cage*: only replies
//	                    [guard: the rest is dropped where cage turned forwarding on]
//	input (filter):     from cage*: replies; else iifname vmap @inp -> chain
//	                    i<slot>: DNS this process redirected to its resolver,
//	                    else a logged refusal
//	dstnat (nat):       iifname vmap @dns  -> chain d<slot>: DNS to the gateway -> resolver
//	srcnat (nat):       from cage* out elsewhere -> masquerade
//
// Per sandbox: chains s<slot>, i<slot> and d<slot>, set x<slot> (its denied
// ranges), set n<slot> (addresses its allowed names resolved to, until
// their TTL), set p<slot> (the same with a port) and set y<slot> (addresses
// the names it is denied resolve to, in internet mode).
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
	mu    sync.Mutex // the connection and its queued messages
	conn  *nftables.Conn
	netns int        // the namespace's file descriptor
	qmu   sync.Mutex // the queue
	queue []*nftJob  // applies waiting for a group commit
	// noGroup commits each apply alone (the benchmark's peer).
	noGroup bool
	groups  int // group commits of more than one apply (for tests)
	table   *nftables.Table
	fwd     *nftables.Set
	inp     *nftables.Set
	dns     *nftables.Set
}

func newNFT() (*nft, error) {
	// The network namespace of the caller, where every batch goes (should
	// the connection be replaced).
	netns, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("nftables: the network namespace: %w", err)
	}
	conn, err := nftables.New(nftables.AsLasting(), nftables.WithNetNSFd(netns), nftables.WithSockOptions(groupSocket))
	if err != nil {
		unix.Close(netns)
		return nil, fmt.Errorf("nftables: %w", err)
	}
	n := &nft{conn: conn, netns: netns, table: &nftables.Table{Name: tableName, Family: nftables.TableFamilyINet}}
	n.fwd = &nftables.Set{Table: n.table, Name: "fwd", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	n.inp = &nftables.Set{Table: n.table, Name: "inp", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	n.dns = &nftables.Set{Table: n.table, Name: "dns", IsMap: true, KeyType: nftables.TypeIFName, DataType: nftables.TypeVerdict}
	return n, nil
}

func (n *nft) close() {
	_ = n.conn.CloseLasting()
	unix.Close(n.netns)
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

func (n *nft) names(slot int) (filter, input, nat string) {
	v := strconv.Itoa(slot)
	return "s" + v, "i" + v, "d" + v
}

// slotSets are a sandbox's sets.
type slotSets struct{ deny, names, ports, dnames *nftables.Set }

func (n *nft) sets(slot int) slotSets {
	v := strconv.Itoa(slot)
	return slotSets{
		deny:  &nftables.Set{Table: n.table, Name: "x" + v, KeyType: nftables.TypeIPAddr, Interval: true},
		names: &nftables.Set{Table: n.table, Name: "n" + v, KeyType: nftables.TypeIPAddr, HasTimeout: true},
		ports: &nftables.Set{Table: n.table, Name: "p" + v, KeyType: nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetService),
			HasTimeout: true, Concatenation: true},
		dnames: &nftables.Set{Table: n.table, Name: "y" + v, KeyType: nftables.TypeIPAddr},
	}
}

func (s slotSets) all() []*nftables.Set { return []*nftables.Set{s.deny, s.names, s.ports, s.dnames} }

// setState is what a sandbox's sets hold besides its denied ranges.
type setState struct {
	learned []learnedAddr // addresses its allowed names resolved to
	denied  []netip.Addr  // addresses its denied names resolved to
}

// learnedAddr is an address an allowed name resolved to, for its ports (0:
// every port), for ttl more.
type learnedAddr struct {
	addr  netip.Addr
	ports []uint16
	ttl   time.Duration
}

// apply creates a sandbox's objects or replaces what they hold, in one
// batch the kernel applies atomically: there is no moment when the old
// policy's learned addresses meet the new policy's rules. Objects are
// created if missing (a new sandbox, or one a process of an older cage
// made) and emptied if present (a policy change, an adopting process with
// its own resolver and log group, the leftovers of a dead owner).
//
// Applies that arrive while another commit is in progress are committed
// together (group commit): the kernel validates the whole table on every
// commit that adds jumps, so with many sandboxes alive a commit costs in
// proportion to their number, and a burst of creates pays it once instead
// of once each. Each apply's objects stay whole in the one batch; if the
// batch fails, each apply is committed again alone, so one sandbox's
// failure is its own.
func (n *nft) apply(s *sandboxRules, st setState) error {
	j := &nftJob{slot: s.slot, build: func(c *nftables.Conn) error { return n.build(c, s, st) }, done: make(chan error, 1)}
	n.enqueue(j)
	return <-j.done
}

// nftJob is one sandbox's batch, waiting for a group commit.
type nftJob struct {
	slot  int
	build func(c *nftables.Conn) error // queues the job's messages
	done  chan error                   // its result (buffered)
}

// enqueue queues a job and commits what is queued. Whoever holds mu next
// commits every job queued by then (at most one per slot, in order), so a
// job is committed at the latest by its own caller.
func (n *nft) enqueue(j *nftJob) {
	n.qmu.Lock()
	n.queue = append(n.queue, j)
	n.qmu.Unlock()
	n.mu.Lock()
	defer n.mu.Unlock()
	n.qmu.Lock()
	var batch []*nftJob
	seen := map[int]bool{}
	for len(n.queue) > 0 && !seen[n.queue[0].slot] && len(batch) < maxGroup {
		seen[n.queue[0].slot] = true
		batch = append(batch, n.queue[0])
		n.queue = n.queue[1:]
	}
	n.qmu.Unlock()
	if len(batch) > 0 {
		n.commit(batch)
	}
}

// maxGroup bounds the jobs of one group commit (a netlink batch of a few
// hundred KiB at most).
const maxGroup = 32

// commit commits jobs in one batch, or each alone where the batch fails
// (the kernel applied none of it). A job whose build fails (a malformed
// object) is found on a dry connection first, which never reaches the
// kernel, so that no half-built job is ever queued. The caller holds mu.
func (n *nft) commit(batch []*nftJob) {
	var ok []*nftJob
	for _, j := range batch {
		dry, err := nftables.New() // no socket: only for building
		if err == nil {
			err = j.build(dry)
		}
		if err != nil {
			j.done <- fmt.Errorf("nftables: rules of sandbox slot %d: %w", j.slot, err)
			continue
		}
		ok = append(ok, j)
	}
	if len(ok) > 1 && !n.noGroup {
		if n.flush(ok...) == nil {
			n.groups++
			for _, j := range ok {
				j.done <- nil
			}
			return
		}
	}
	for _, j := range ok {
		if err := n.flush(j); err != nil {
			j.done <- fmt.Errorf("nftables: rules of sandbox slot %d: %w", j.slot, err)
			continue
		}
		j.done <- nil
	}
}

// flush queues jobs on the connection and commits them in one batch.
func (n *nft) flush(jobs ...*nftJob) error {
	for _, j := range jobs {
		if err := j.build(n.conn); err != nil {
			// It built on the dry connection: this does not happen. Should
			// it, what it queued must not reach the kernel.
			n.reset()
			return err
		}
	}
	return n.conn.Flush()
}

// reset replaces the connection, dropping what is queued on it.
func (n *nft) reset() {
	c, err := nftables.New(nftables.AsLasting(), nftables.WithNetNSFd(n.netns), nftables.WithSockOptions(groupSocket))
	if err != nil {
		return
	}
	_ = n.conn.CloseLasting()
	n.conn = c
}

// groupSocket makes a batch's socket able to take the acknowledgements of
// a group's hundreds of messages: acknowledgements without the request in
// them (NETLINK_CAP_ACK), and room for them (else ENOBUFS, and the batch
// is committed again alone).
func groupSocket(c *netlink.Conn) error {
	if err := c.SetOption(netlink.CapAcknowledge, true); err != nil {
		return err
	}
	return c.SetReadBuffer(4 << 20)
}

// build queues a sandbox's objects and rules on c (the caller holds mu).
func (n *nft) build(c *nftables.Conn, s *sandboxRules, st setState) error {
	fname, iname, nname := n.names(s.slot)
	filter := &nftables.Chain{Name: fname, Table: n.table}
	input := &nftables.Chain{Name: iname, Table: n.table}
	nat := &nftables.Chain{Name: nname, Table: n.table}
	sets := n.sets(s.slot)
	for _, ch := range []*nftables.Chain{filter, input, nat} {
		c.AddChain(ch)
		c.FlushChain(ch)
	}
	for _, set := range sets.all() {
		if err := c.AddSet(set, nil); err != nil {
			return err
		}
		c.FlushSet(set)
	}
	if err := c.SetAddElements(sets.deny, intervalElements(s.denied)); err != nil {
		return err
	}
	if err := addLearned(c, sets, st.learned); err != nil {
		return err
	}
	if len(st.denied) > 0 {
		if err := c.SetAddElements(sets.dnames, addrElements(st.denied)); err != nil {
			return err
		}
	}
	for _, r := range policyRules(s, sets) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: filter, Exprs: r})
	}
	for _, r := range inputRules(s) {
		c.AddRule(&nftables.Rule{Table: n.table, Chain: input, Exprs: r})
	}
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
	key := ifKey(s.ifname())
	for _, m := range []struct {
		set   *nftables.Set
		chain string
	}{{n.fwd, fname}, {n.inp, iname}, {n.dns, nname}} {
		if err := c.SetAddElements(m.set, []nftables.SetElement{{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: m.chain}}}); err != nil {
			return err
		}
	}
	return nil
}

// inputRules is a sandbox's input chain: to the host itself, only DNS that
// this process's own redirect sent to its resolver (the gateway's port 53
// rewritten to the resolver's port), at most dnsPackets a second (the rest
// is dropped here, so that a flood costs the resolver nothing), and
// replies; then a logged refusal. A connection some other table redirected
// to the host is refused like any other.
func inputRules(s *sandboxRules) [][]expr.Any {
	var rs [][]expr.Any
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		ours := cat(ipField(16, s.gateway), l4proto(proto), dport(s.resolver), ctStatus(ipsDstNAT), ctOrigDport(53))
		rs = append(rs,
			cat(ours, []expr.Any{&expr.Limit{Type: expr.LimitTypePkts, Rate: dnsPackets, Unit: expr.LimitTimeSecond, Burst: dnsBurst, Over: true}},
				verdict(expr.VerdictDrop)),
			cat(ours, verdict(expr.VerdictAccept)))
	}
	rs = append(rs, cat(ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept)))
	return append(rs, cat(s.log(logDeny), reject()), reject())
}

// A sandbox's DNS packets to the resolver, a second and at once, per
// protocol; above the resolver's own rate of questions (queryRate), so
// that this only stops floods.
const (
	dnsPackets = 2 * queryRate
	dnsBurst   = 2 * queryBurst
)

// addLearned queues the addition of learned addresses on c (the caller holds
// mu and flushes).
func addLearned(c *nftables.Conn, sets slotSets, learned []learnedAddr) error {
	var any, withPort []nftables.SetElement
	for _, l := range learned {
		b := l.addr.As4()
		for _, p := range l.ports {
			if p == 0 {
				any = append(any, nftables.SetElement{Key: b[:], Timeout: l.ttl})
			} else {
				withPort = append(withPort, nftables.SetElement{Key: append(b[:], byte(p>>8), byte(p), 0, 0), Timeout: l.ttl})
			}
		}
	}
	if len(any) > 0 {
		if err := c.SetAddElements(sets.names, any); err != nil {
			return err
		}
	}
	if len(withPort) > 0 {
		if err := c.SetAddElements(sets.ports, withPort); err != nil {
			return err
		}
	}
	return nil
}

func addrElements(addrs []netip.Addr) []nftables.SetElement {
	els := make([]nftables.SetElement, 0, len(addrs))
	for _, a := range addrs {
		b := a.As4()
		els = append(els, nftables.SetElement{Key: b[:]})
	}
	return els
}

// remove deletes a sandbox's objects. Missing ones are not an error (a
// half-made sandbox, or GC after its owner removed some): the usual case,
// every object there, is one batch; where that fails (a batch fails whole
// on the first missing object) each step is a batch of its own.
func (n *nft) remove(slot int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.conn
	key := ifKey(ifName(slot))
	fname, iname, nname := n.names(slot)
	var steps []func()
	for _, m := range []*nftables.Set{n.fwd, n.inp, n.dns} {
		steps = append(steps, func() { _ = c.SetDeleteElements(m, []nftables.SetElement{{Key: key}}) })
	}
	for _, name := range []string{fname, iname, nname} {
		ch := &nftables.Chain{Name: name, Table: n.table}
		steps = append(steps, func() { c.FlushChain(ch) }, func() { c.DelChain(ch) })
	}
	for _, set := range n.sets(slot).all() {
		steps = append(steps, func() { c.DelSet(set) })
	}
	for _, step := range steps {
		step()
	}
	if c.Flush() == nil {
		return nil
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

// learn adds addresses an allowed name resolved to.
func (n *nft) learn(slot int, learned []learnedAddr) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := addLearned(n.conn, n.sets(slot), learned); err != nil {
		return err
	}
	return n.conn.Flush()
}

// deny adds addresses to and removes addresses from a sandbox's set of
// denied names' addresses. The caller knows that those it removes are in
// the set.
func (n *nft) deny(slot int, add, del []netip.Addr) error {
	if len(add) == 0 && len(del) == 0 {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	set := n.sets(slot).dnames
	if len(del) > 0 {
		if err := n.conn.SetDeleteElements(set, addrElements(del)); err != nil {
			return err
		}
	}
	if len(add) > 0 {
		if err := n.conn.SetAddElements(set, addrElements(add)); err != nil {
			return err
		}
	}
	return n.conn.Flush()
}

// elements lists the addresses in one of a sandbox's sets ("n", "p" or
// "y"), for tests and checks.
func (n *nft) elements(slot int, which string) ([]netip.Addr, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	sets := n.sets(slot)
	set := map[string]*nftables.Set{"n": sets.names, "p": sets.ports, "y": sets.dnames}[which]
	if set == nil {
		return nil, fmt.Errorf("no set %q", which)
	}
	els, err := n.conn.GetSetElements(set)
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, e := range els {
		if len(e.Key) >= 4 {
			out = append(out, netip.AddrFrom4([4]byte(e.Key[:4])))
		}
	}
	return out, nil
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
func policyRules(s *sandboxRules, sets slotSets) [][]expr.Any {
	var rs [][]expr.Any
	add := func(e ...[]expr.Any) { rs = append(rs, cat(e...)) }
	accept, drop, refused := verdict(expr.VerdictAccept), verdict(expr.VerdictDrop), refuse()
	allowLogged := func(match ...[]expr.Any) {
		add(append(match, s.log(logAllow), accept)...)
		add(append(match, accept)...)
	}
	// Denied connections are refused at once (ICMP "administratively
	// prohibited"; a TCP reset for a connection a policy change cut): a
	// program inside fails fast instead of timing out.
	denyLogged := func(match ...[]expr.Any) {
		add(append(match, s.log(logDeny), refused)...)
		add(append(match, refused)...)
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
	denyLogged(lookup(16, sets.deny.Name, false))
	for _, r := range s.policy.Allow {
		if r.Name == "" {
			for _, m := range prefixMatch(r) {
				allowLogged(m...)
			}
		}
	}
	allowLogged(lookup(16, sets.names.Name, false))
	allowLogged(portLookup(unix.IPPROTO_TCP, sets.ports.Name))
	allowLogged(portLookup(unix.IPPROTO_UDP, sets.ports.Name))
	if s.policy.Mode == Internet {
		for _, r := range s.policy.Deny {
			if r.Name == "" {
				for _, m := range prefixMatch(r) {
					denyLogged(m...)
				}
			}
		}
		// The addresses denied names resolve to (an allow entry, above,
		// still wins: in internet mode allow overrides deny).
		denyLogged(lookup(16, sets.dnames.Name, false))
		add(s.log(logAllow), accept)
		add(accept)
		return rs
	}
	add(s.log(logDeny), refused)
	add(refused)
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
