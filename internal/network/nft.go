package network

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// cage's rules live in one nftables table of its own, "inet cage", shared by
// every cage process on the host (a daemon and any number of `cage run`).
// Its chains and sets are fixed: a sandbox is a handful of elements in
// shared sets and maps, so that adding, changing or removing one costs the
// same with none or thousands alive (no chain, jump or named set per
// sandbox, and no verdict element either: the kernel validates the whole
// table on a commit that adds jumps). Each process adds and removes only
// its own sandboxes' elements and never flushes the table.
//
// A sandbox's elements are keyed by an id (sbxID: its denied-ranges
// profile, its owner's log group, 8 random bytes) that the sbx map gives
// for the sandbox's interface and address; a new id is drawn for every
// attach, policy change and adoption, and the sbx entry is switched to it in
// the batch that adds the new elements. So a policy change is one atomic
// commit, and nothing of an earlier generation (this sandbox's, or a dead
// one's on the same slot) matches again; what a dead owner left is swept.
//
//	early (filter, prerouting, before defragmentation):
//	                   iifname cage*, an IPv4 fragment or IP options -> drop
//	forward (filter):  iifname cage* -> goto fromsbx; to cage*: only replies
//	                   [guard: the rest is dropped where cage turned forwarding on]
//	fromsbx:           not IPv4, or iifname . ip saddr not in @sbx -> drop;
//	                   replies -> accept; DNS/DoT elsewhere -> refuse;
//	                   profile . daddr in @xdeny -> refuse;
//	                   id . daddr [. dport] in @allow/@allowp/@names/@namesp -> accept;
//	                   id . daddr [. dport] in @deny/@denyp/@dnames -> refuse;
//	                   id in @internet -> accept; else refuse
//	input (filter):    iifname cage* -> goto tohost: DNS this process redirected
//	                   (id . daddr . dport in @dnsin) at most dnsPackets a second
//	                   per source and protocol (@dnslim); replies; else refused
//	dstnat (nat):      DNS to the gateway -> redirect to (id . daddr map @dnat)
//	srcnat (nat):      from cage* out elsewhere -> masquerade
//	la<g>, ld<g>:      per owning process (log group g, reached through the
//	                   loga/logd maps keyed by the id's group): log an
//	                   allowed / refused new connection, at most 20 a second
//	                   per sandbox (@lima, @limd), prefix "cage a" / "cage d"
//
// The log records name the sandbox by the packet's source address (the sbx
// check has tied it to the interface). See nftbase.go for the base and the
// upgrade from the older layout, nftrules.go for the rules.
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
	mu    sync.Mutex // the connection, its queued messages and state
	conn  *nftables.Conn
	netns int        // the namespace's file descriptor
	qmu   sync.Mutex // the queue
	queue []*nftJob  // applies waiting for a group commit
	// noGroup commits each apply alone (the benchmark's peer).
	noGroup bool
	groups  int // group commits of more than one apply (for tests)
	table   *nftables.Table
	sets    map[string]*nftables.Set
	// state is what this process's sandboxes have in the table, by slot.
	state map[int]*applied
	group uint16 // this process's log group (ensureBase)
}

// applied is one sandbox's generation of elements in the table.
type applied struct {
	id     sbxID
	key    []byte // its entry in sbx: iifname . address
	static []elem // its policy's elements
	dnames map[netip.Addr]bool
	// learned is what it added of learned addresses (elements with a
	// timeout), each with the earliest the kernel may expire it: the
	// generation a policy change or a close ends deletes those it still
	// holds (see liveLearned).
	learned map[learnedKey]keptElem
}

// learnedKey names a learned element: its set and key.
type learnedKey struct{ set, key string }

// keptElem is a learned element with the earliest moment the kernel may
// expire it: an element added again (the same answer asked again) keeps
// its first expiry on some kernels and takes the new one on others, so
// the earlier of the two is kept.
type keptElem struct {
	el    elem
	until time.Time
}

// keep records learned elements added at now (before the batch that
// adds them was sent). Past maxSandboxElems records, those the kernel has
// surely expired are forgotten.
func (a *applied) keep(els []elem, now time.Time) {
	if a.learned == nil {
		a.learned = map[learnedKey]keptElem{}
	}
	if len(a.learned) >= 2*maxSandboxElems {
		maps.DeleteFunc(a.learned, func(_ learnedKey, k keptElem) bool { return !k.until.After(now) })
	}
	for _, e := range els {
		k := learnedKey{e.set, string(e.el.Key)}
		until := now.Add(e.el.Timeout)
		if old, ok := a.learned[k]; ok && old.until.Before(until) {
			until = old.until
		}
		a.learned[k] = keptElem{e, until}
	}
}

// liveLearned is the learned elements the kernel still holds for a while
// (learnedMargin) after now: deleting one it has expired would fail the
// whole batch, so those closer to their end are left to expire.
func (a *applied) liveLearned(now time.Time) []elem {
	var out []elem
	for _, k := range a.learned {
		if k.until.After(now.Add(learnedMargin)) {
			out = append(out, k.el)
		}
	}
	return out
}

// learnedMargin is how long before its earliest expiry a learned element
// is no longer deleted but left to expire.
const learnedMargin = 2 * time.Second

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
	n := &nft{conn: conn, netns: netns, table: &nftables.Table{Name: tableName, Family: nftables.TableFamilyINet}, state: map[int]*applied{}}
	n.makeSets()
	return n, nil
}

// errNFTClosed is what the table's operations say once close has run.
var errNFTClosed = errors.New("nftables: the host's network is closed")

// close ends the connection and lets go of the namespace's descriptor.
// What comes after (a sandbox's removal, a resolver's learning, a denied
// name's refresh still under way) fails with errNFTClosed: it goes to a
// connection that never dials. Before, the closed connection dialled
// again on its next use, joining the namespace by the descriptor's number,
// which by then another file may have taken (a sandbox's namespace, or a
// file that setns refuses, which cost the thread: a locked thread that
// failed it was ended, and with it any child whose parent-death signal it
// carried).
func (n *nft) close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.netns < 0 {
		return
	}
	_ = n.conn.CloseLasting()
	n.conn, _ = nftables.New(nftables.WithTestDial(func([]netlink.Message) ([]netlink.Message, error) {
		return nil, errNFTClosed
	}))
	unix.Close(n.netns)
	n.netns = -1
}

// sandboxRules is what a sandbox's elements are made from.
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

// setState is what a sandbox's sets hold besides its policy's elements.
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

// apply writes a sandbox's elements under a new id and points its sbx entry
// at them, in one batch the kernel applies atomically: there is no moment
// when the old policy's learned addresses meet the new policy's elements.
// The elements of the generation it replaces (this process's) go in the
// same batch; where the entry is someone else's (an older process's, a dead
// owner's leftover, an adopted sandbox), it is replaced and what it pointed
// at is swept later (it matches nothing any more).
//
// Applies that arrive while another commit is in progress are committed
// together (group commit): each commit costs a fixed part (a netlink round
// trip, the kernel's transaction), which a burst of creates pays once. Each
// apply stays whole in the one batch; if the batch fails, each apply is
// committed again alone, so one sandbox's failure is its own. leftover
// says the slot's entry was another's, which this apply replaced (its
// owner died without removing it).
func (n *nft) apply(s *sandboxRules, st setState) (leftover bool, err error) {
	id, err := newID(profileOf(s.denied), s.group)
	if err != nil {
		return false, err
	}
	next := &applied{id: id, key: sbxKey(s.ifname(), s.ip), static: staticElements(s, id), dnames: map[netip.Addr]bool{}}
	for _, a := range st.denied {
		next.dnames[a] = true
	}
	learned := learnedElems(id, st.learned)
	next.keep(learned, time.Now())
	fresh := slices.Concat(next.static, learned, dnameElems(id, st.denied))
	j := &nftJob{slot: s.slot, done: make(chan error, 1)}
	j.build = func(c *nftables.Conn) error { return n.buildApply(c, next, fresh, n.state[s.slot], false) }
	j.retry = func(c *nftables.Conn) error { leftover = true; return n.buildApply(c, next, fresh, nil, true) }
	j.committed = func() { n.state[s.slot] = next }
	n.enqueue(j)
	err = <-j.done
	return leftover, err
}

// buildApply queues a generation's elements and its sbx entry: added (a
// new sandbox), in place of prev's (this process's), or in place of
// whatever is there (replace). The caller holds mu.
func (n *nft) buildApply(c *nftables.Conn, next *applied, fresh []elem, prev *applied, replace bool) error {
	if err := n.addElems(c, fresh); err != nil {
		return err
	}
	sbx := n.sets[setSbx]
	if prev != nil || replace {
		if err := c.SetDeleteElements(sbx, []nftables.SetElement{{Key: next.key}}); err != nil {
			return err
		}
	}
	if err := c.SetAddElements(sbx, []nftables.SetElement{{Key: next.key, Val: next.id[:]}}); err != nil {
		return err
	}
	if prev != nil {
		// The learned addresses of the generation it replaces go too:
		// left to their TTL (an hour at most), every policy change left
		// the sandbox's learned elements behind, 4,096 each (found by
		// review, 2026-12-05: 86,016 in the set after 20 changes of one
		// sandbox's policy in 0.8 s).
		return n.delElems(c, slices.Concat(prev.all(), prev.liveLearned(time.Now())))
	}
	return nil
}

// all is a generation's elements that do not expire.
func (a *applied) all() []elem {
	return slices.Concat(a.static, dnameElems(a.id, slices.Collect(maps.Keys(a.dnames))))
}

// nftJob is one sandbox's batch, waiting for a group commit.
type nftJob struct {
	slot      int
	build     func(c *nftables.Conn) error // queues the job's messages
	retry     func(c *nftables.Conn) error // tried alone where build is refused (may be nil)
	committed func()                       // after its commit, under mu (may be nil)
	done      chan error                   // its result (buffered)
}

func (j *nftJob) finish() {
	if j.committed != nil {
		j.committed()
	}
	j.done <- nil
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
// element) is found on a dry connection first, which never reaches the
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
		builds := make([]func(*nftables.Conn) error, len(ok))
		for i, j := range ok {
			builds[i] = j.build
		}
		if n.flush(builds...) == nil {
			n.groups++
			for _, j := range ok {
				j.finish()
			}
			return
		}
	}
	for _, j := range ok {
		err := n.flush(j.build)
		if err != nil && j.retry != nil && n.flush(j.retry) == nil {
			err = nil
		}
		if err != nil {
			j.done <- fmt.Errorf("nftables: rules of sandbox slot %d: %w", j.slot, err)
			continue
		}
		j.finish()
	}
}

// flush queues builds on the connection and commits them in one batch.
func (n *nft) flush(builds ...func(*nftables.Conn) error) error {
	for _, b := range builds {
		if err := b(n.conn); err != nil {
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
	if n.netns < 0 {
		return // closed
	}
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
	if err := c.SetReadBuffer(4 << 20); err != nil {
		return err
	}
	// A batch is one sendmsg, refused (EMSGSIZE) past the send buffer:
	// a policy change of a sandbox holding thousands of learned and denied
	// addresses is a few hundred KiB. Past net.core.wmem_max as root
	// (SO_SNDBUFFORCE), else as far as it allows.
	if raw, err := c.SyscallConn(); err == nil {
		var serr error
		if err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, 4<<20)
		}); err == nil && serr == nil {
			return nil
		}
	}
	_ = c.SetWriteBuffer(4 << 20)
	return nil
}

// A sandbox's DNS packets to the resolver, a second and at once, per
// protocol; above the resolver's own rate of questions (queryRate), so
// that this only stops floods.
const (
	dnsPackets = 2 * queryRate
	dnsBurst   = 2 * queryBurst
)

// remove deletes a sandbox's elements: its sbx entry first (once it is
// gone, nothing of the sandbox matches), with the elements this process
// knows it has, in one batch. Missing ones are not an error (a half-made
// sandbox, GC after its owner removed some, a dead owner's sandbox whose
// elements this process does not know): then the entry goes alone, and
// what is left is swept.
func (n *nft) remove(slot int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	st := n.state[slot]
	delete(n.state, slot)
	var keys []nftables.SetElement
	if st != nil {
		keys = []nftables.SetElement{{Key: st.key}}
	} else {
		entries, err := n.entries()
		if err != nil {
			return err
		}
		for _, e := range entries {
			if e.slot == slot {
				keys = append(keys, nftables.SetElement{Key: e.key})
			}
		}
	}
	if len(keys) == 0 {
		return nil
	}
	c, sbx := n.conn, n.sets[setSbx]
	if err := c.SetDeleteElements(sbx, keys); err != nil {
		return err
	}
	if st != nil {
		if err := n.delElems(c, slices.Concat(st.all(), st.liveLearned(time.Now()))); err != nil {
			n.reset()
			return err
		}
	}
	if c.Flush() == nil {
		return nil
	}
	var first error
	for _, k := range keys {
		_ = c.SetDeleteElements(sbx, []nftables.SetElement{k})
		if err := c.Flush(); err != nil && !isNotFound(err) && first == nil {
			first = err
		}
	}
	if st != nil {
		for _, g := range groupBySet(slices.Concat(st.all(), st.liveLearned(time.Now()))) {
			for _, e := range g.els {
				_ = n.delElems(c, []elem{{g.set, e}})
				_ = c.Flush() // what is missing was swept already
			}
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
	st := n.state[slot]
	if st == nil {
		return fmt.Errorf("nftables: sandbox slot %d has no elements", slot)
	}
	els := learnedElems(st.id, learned)
	if err := n.addElems(n.conn, els); err != nil {
		return err
	}
	now := time.Now()
	if err := n.conn.Flush(); err != nil {
		return err
	}
	st.keep(els, now)
	return nil
}

// deny adds addresses to and removes addresses from a sandbox's denied
// names' addresses. The caller knows that those it removes are there.
func (n *nft) deny(slot int, add, del []netip.Addr) error {
	if len(add) == 0 && len(del) == 0 {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	st := n.state[slot]
	if st == nil {
		return fmt.Errorf("nftables: sandbox slot %d has no elements", slot)
	}
	if err := n.delElems(n.conn, dnameElems(st.id, del)); err != nil {
		return err
	}
	if err := n.addElems(n.conn, dnameElems(st.id, add)); err != nil {
		return err
	}
	if err := n.conn.Flush(); err != nil {
		return err
	}
	for _, a := range del {
		delete(st.dnames, a)
	}
	for _, a := range add {
		st.dnames[a] = true
	}
	return nil
}
