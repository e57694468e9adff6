package network

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Sandbox is the network of one sandbox.
//
// What its sets hold follows its policy, under one lock: a policy change
// bumps the generation, rewrites the rules and the sets in one batch
// (keeping only the learned addresses of names the new policy still allows)
// and then cuts the tracked connections the new policy refuses; an answer
// the resolver got under an older generation is never added.
type Sandbox struct {
	ID   string
	Slot int
	IP   netip.Addr
	h    *Host
	link int // index of the host's end of its interface (see Host.sender)
	// ns holds the sandbox's network namespace (-1: not held, an adopted
	// one's) until Close, so that its end of the pair outlives its last
	// process (the kernel destroys a namespace nobody holds, and the pair
	// with it) and Close can read what the pair carried (carriedNothing).
	ns int

	mu     sync.Mutex
	policy Policy
	gen    uint64 // bumped by every policy change
	// learned: allowed names whose addresses are in the n/p sets, each
	// address until its TTL ends.
	learned map[string]map[netip.Addr]time.Time
	// denied: names the policy denies (internet mode) and the addresses
	// they resolved to, until their TTL ends; inY is what the y set holds,
	// each address with how many denied names hold it.
	denied map[string]map[netip.Addr]time.Time
	inY    map[netip.Addr]int
	// elems is how many elements of the shared sets the learned and
	// denied addresses take (an address learned for a name with ports
	// takes one per port), held under maxSandboxElems.
	elems int
	// pairs is how many name-address pairs denied holds, held under
	// maxSandboxElems too (names the policy denies exactly aside: the
	// policy bounds them). Every name of a wildcard is remembered with
	// its addresses, whether or not they are new to the set.
	pairs  int
	closed bool

	queries  limiter      // DNS questions a second
	tcpConns atomic.Int32 // TCP connections to the resolver (maxTCPConns)
	asking   gauge        // questions on their way upstream (maxAsking)
}

// errStale says the policy changed while an answer was on its way.
var errStale = errors.New("the sandbox's policy changed while the answer was on its way")

// errGone says the sandbox's network was closed.
var errGone = errors.New("the sandbox's network is gone")

// maxSandboxElems bounds the set elements one sandbox's DNS answers hold
// at once (learned and denied addresses until their TTL, an hour at most):
// each answer's addresses are bounded too (maxAnswerAddrs), but a sandbox
// asks for new names of a wildcard its tenant allows or denies as fast as
// it may ask (100 a second), and an attacker's own servers answer each
// with as many addresses as fit. Beyond it, an answer is not given.
const maxSandboxElems = 4096

// errFull says an answer would take the sandbox past maxSandboxElems.
var errFull = fmt.Errorf("the sandbox holds %d addresses of DNS answers, its limit", maxSandboxElems)

func newSandbox(h *Host, id string, slot int, p Policy) *Sandbox {
	return &Sandbox{ID: id, Slot: slot, IP: h.IP(slot), h: h, policy: p, ns: -1,
		learned: map[string]map[netip.Addr]time.Time{}, denied: map[string]map[netip.Addr]time.Time{}, inY: map[netip.Addr]int{}}
}

// Policy is the sandbox's current policy.
func (sb *Sandbox) Policy() Policy {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.policy
}

// gone reports whether the sandbox's network was closed.
func (sb *Sandbox) gone() bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.closed
}

// snapshot is the policy and its generation, for an answer to be checked
// against later.
func (sb *Sandbox) snapshot() (Policy, uint64) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.policy, sb.gen
}

// SetPolicy replaces the policy of a running sandbox. Addresses learned for
// names the new policy still allows stay allowed (for the ports it gives
// them) until their TTL; the others are forgotten, and an answer already on
// its way under the old policy is never added. Then the connections the
// sandbox has open (tracked by the host's conntrack) that the new policy
// refuses are cut (should that fail, it is logged as an error: the new
// policy stays in force). Mode none leaves the interface in place with
// nothing allowed.
func (sb *Sandbox) SetPolicy(p Policy) error { return sb.setPolicy(p, true) }

// SetFirstPolicy is SetPolicy for a sandbox in which nothing has run since
// its interface was made (a prepared sandbox's Start): it has no
// connection to cut, so the host's connection table, which grows with
// every sandbox's traffic, is not walked.
func (sb *Sandbox) SetFirstPolicy(p Policy) error { return sb.setPolicy(p, false) }

func (sb *Sandbox) setPolicy(p Policy, cut bool) error {
	if p.Mode == None && len(p.Allow) == 0 && len(p.Deny) == 0 {
		p.Mode = Allowlist
	}
	if err := p.Validate(); err != nil {
		return err
	}
	// The denied names' addresses, asked before the lock is taken (this
	// may wait for the upstream resolvers).
	fresh := sb.h.resolveDenied(p)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.closed {
		return errGone
	}
	now := time.Now()
	learned := map[string]map[netip.Addr]time.Time{}
	for name, addrs := range sb.learned {
		if ok, _ := p.NamePorts(name); ok && p.learns(name) {
			learned[name] = live(addrs, now)
		}
	}
	denied := map[string]map[netip.Addr]time.Time{}
	for name, addrs := range sb.denied {
		if p.deniesName(name) {
			denied[name] = live(addrs, now)
		}
	}
	for name, addrs := range fresh {
		if denied[name] == nil {
			denied[name] = map[netip.Addr]time.Time{}
		}
		maps.Copy(denied[name], addrs)
	}
	st := setState{learned: learnedElements(p, learned, now)}
	inY := refCount(denied)
	pairs := 0
	for _, addrs := range denied {
		pairs += len(addrs)
	}
	st.denied = slices.Collect(maps.Keys(inY))
	elems := len(inY)
	for _, l := range st.learned {
		elems += max(1, len(l.ports))
	}
	if _, err := sb.h.nft.apply(sb.h.rules(sb, p), st); err != nil {
		return err
	}
	sb.gen++
	sb.policy, sb.learned, sb.denied, sb.inY, sb.elems, sb.pairs = p, learned, denied, inY, elems, pairs
	if !cut {
		return nil
	}
	// The policy is in force whatever happens now: an error here must not
	// make the caller record the old one. A dump interrupted by the table
	// changing is tried again.
	err := sb.cutLocked()
	if err != nil {
		err = sb.cutLocked()
	}
	if err != nil {
		sb.h.log.Error("network: the new policy is in force, but cutting the connections it refuses failed", "sandbox", sb.ID, "err", err)
	}
	return nil
}

// refCount is each address of the denied names with how many hold it.
func refCount(denied map[string]map[netip.Addr]time.Time) map[netip.Addr]int {
	out := map[netip.Addr]int{}
	for _, addrs := range denied {
		for a := range addrs {
			out[a]++
		}
	}
	return out
}

// live is the addresses of m whose time has not passed.
func live(m map[netip.Addr]time.Time, now time.Time) map[netip.Addr]time.Time {
	out := map[netip.Addr]time.Time{}
	for a, until := range m {
		if until.After(now) {
			out[a] = until
		}
	}
	return out
}

// learnedElements are the set elements of learned names under p.
func learnedElements(p Policy, learned map[string]map[netip.Addr]time.Time, now time.Time) []learnedAddr {
	var out []learnedAddr
	for name, addrs := range learned {
		_, ports := p.NamePorts(name)
		for a, until := range addrs {
			if ttl := until.Sub(now).Round(time.Second); ttl >= time.Second {
				out = append(out, learnedAddr{addr: a, ports: ports, ttl: ttl})
			}
		}
	}
	return out
}

// commit adds what the resolver learnt of name, asked under generation
// gen: the addresses of an allowed name to the learned sets (when the
// policy needs them, see Policy.learns), those of a denied name to the
// denied set. An answer of an older generation is refused (errStale).
func (sb *Sandbox) commit(gen uint64, name string, addrs []netip.Addr, ttl time.Duration) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.closed {
		return errGone
	}
	if gen != sb.gen {
		return errStale
	}
	if len(addrs) == 0 {
		return nil
	}
	until := time.Now().Add(ttl)
	if sb.policy.deniesName(name) {
		return sb.denyLocked(name, addrs, until)
	}
	ok, ports := sb.policy.NamePorts(name)
	if !ok || !sb.policy.learns(name) {
		return nil
	}
	m := sb.learned[name]
	fresh := 0
	for _, a := range addrs {
		if _, ok := m[a]; !ok {
			fresh++
		}
	}
	grow := fresh * max(1, len(ports))
	if sb.elems+grow > maxSandboxElems {
		return errFull
	}
	if err := sb.h.nft.learn(sb.Slot, learnedFor(addrs, ports, ttl)); err != nil {
		return err
	}
	if m == nil {
		m = map[netip.Addr]time.Time{}
		sb.learned[name] = m
	}
	for _, a := range addrs {
		m[a] = until
	}
	sb.elems += grow
	return nil
}

func learnedFor(addrs []netip.Addr, ports []uint16, ttl time.Duration) []learnedAddr {
	out := make([]learnedAddr, 0, len(addrs))
	for _, a := range addrs {
		out = append(out, learnedAddr{addr: a, ports: ports, ttl: ttl})
	}
	return out
}

// denyLocked adds a denied name's addresses to the denied set until until.
func (sb *Sandbox) denyLocked(name string, addrs []netip.Addr, until time.Time) error {
	m := sb.denied[name]
	var add []netip.Addr
	for _, a := range addrs {
		if _, in := sb.inY[a]; !in && !slices.Contains(add, a) {
			add = append(add, a)
		}
	}
	fresh := 0
	for _, a := range addrs {
		if _, held := m[a]; !held {
			fresh++
		}
	}
	// A name the policy denies by its exact name is bounded by the policy
	// (its entries, maxAnswerAddrs each) and is always denied in full.
	// Another (a wildcard's) is bounded by the set elements it adds and by
	// the pairs it is remembered with: a wildcard's names that all
	// answered the same addresses added no element after the first, and
	// each was remembered (found by review, 2026-12-05: 280 names, 8,960
	// pairs and 3 MiB of the daemon's heap within 6 s, 100 names a second
	// for the TTL, an hour).
	if (sb.elems+len(add) > maxSandboxElems || sb.pairs+fresh > maxSandboxElems) && !slices.Contains(sb.policy.exactDenyNames(), name) {
		return errFull
	}
	if err := sb.h.nft.deny(sb.Slot, add, nil); err != nil {
		return err
	}
	sb.elems += len(add)
	sb.pairs += fresh
	if m == nil {
		m = map[netip.Addr]time.Time{}
		sb.denied[name] = m
	}
	for _, a := range addrs {
		if _, held := m[a]; !held {
			sb.inY[a]++
		}
		if until.After(m[a]) {
			m[a] = until
		}
	}
	return nil
}

// expire forgets what has outlived its TTL: learned names (the kernel
// removes their set elements itself) and denied names' addresses no
// denied name still resolves to (removed from the denied set here).
func (sb *Sandbox) expire(now time.Time) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.closed {
		return nil
	}
	for name, addrs := range sb.learned {
		n := len(addrs)
		maps.DeleteFunc(addrs, func(_ netip.Addr, until time.Time) bool { return !until.After(now) })
		if gone := n - len(addrs); gone > 0 {
			_, ports := sb.policy.NamePorts(name)
			sb.elems -= gone * max(1, len(ports))
		}
		if len(addrs) == 0 {
			delete(sb.learned, name)
		}
	}
	for name, addrs := range sb.denied {
		maps.DeleteFunc(addrs, func(a netip.Addr, until time.Time) bool {
			if until.After(now) {
				return false
			}
			sb.inY[a]--
			sb.pairs--
			return true
		})
		if len(addrs) == 0 {
			delete(sb.denied, name)
		}
	}
	// An address no denied name holds leaves the set (one whose removal
	// failed stays in inY, at zero, and is tried again next time).
	var del []netip.Addr
	for a, n := range sb.inY {
		if n <= 0 {
			del = append(del, a)
		}
	}
	if err := sb.h.nft.deny(sb.Slot, nil, del); err != nil {
		return err
	}
	for _, a := range del {
		delete(sb.inY, a)
	}
	sb.elems = max(0, sb.elems-len(del))
	return nil
}

// Close removes the sandbox's rules and interface, and forgets its tracked
// connections (see forgetFlows) before its slot can be another's.
func (sb *Sandbox) Close() error {
	sb.mu.Lock()
	if sb.closed {
		sb.mu.Unlock()
		return nil
	}
	sb.closed = true
	sb.mu.Unlock()
	h := sb.h
	h.mu.Lock()
	if h.bySlot[sb.Slot] == sb {
		delete(h.bySlot, sb.Slot)
		delete(h.byIP, sb.IP)
	}
	h.mu.Unlock()
	// The rules first: once the slot's elements are gone, the host
	// refuses whatever the sandbox sends and any new connection to it, so
	// nothing new is tracked for the address. An interface pair that never
	// carried a packet left nothing tracked (carriedNothing), and its end
	// walks no table.
	err := h.nft.remove(sb.Slot)
	quiet := carriedNothing(sb.Slot)
	err = errors.Join(err, sb.dropLink())
	if quiet {
		quietEnds.Add(1)
		return err
	}
	return errors.Join(err, forgetFlows(sb.IP))
}

// dropLink removes the sandbox's interface pair. A namespace held only by
// Close's hold (its processes gone and its pin removed, as every wall's
// teardown does before it closes the network) is let go, and the kernel
// takes the pair with it, many namespaces' at once (9-56 ms here in bursts
// of 20 kills), without the rtnl lock taken for each pair; Close waits
// for that a little, then removes the pair itself (a namespace something
// else still holds).
func (sb *Sandbox) dropLink() error {
	if sb.ns < 0 {
		return removeLink(sb.Slot)
	}
	unix.Close(sb.ns)
	sb.ns = -1
	wait := 500 * time.Microsecond
	for end := time.Now().Add(linkGoneWait); time.Now().Before(end); wait = min(2*wait, 50*time.Millisecond) {
		if !linkExists(sb.link) {
			return nil
		}
		time.Sleep(wait)
	}
	return removeLink(sb.Slot)
}

// linkGoneWait is how long Close waits for the kernel to take a pair
// whose namespace it let go.
const linkGoneWait = 100 * time.Millisecond

// quietEnds counts the Closes that found nothing to forget (for tests).
var quietEnds atomic.Int64

// start writes the sandbox's objects for its first policy: its denied
// names' addresses are resolved first. leftover says the slot's rules were
// a dead owner's (see nft.apply).
func (sb *Sandbox) start() (leftover bool, err error) {
	fresh := sb.h.resolveDenied(sb.policy)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var st setState
	for name, addrs := range fresh {
		sb.denied[name] = addrs
		sb.pairs += len(addrs)
		for a := range addrs {
			if sb.inY[a] == 0 {
				st.denied = append(st.denied, a)
			}
			sb.inY[a]++
		}
	}
	sb.elems = len(sb.inY)
	return sb.h.nft.apply(sb.h.rules(sb, sb.policy), st)
}
