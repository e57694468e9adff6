package network

import (
	"crypto/rand"
	"encoding/binary"
	"hash/fnv"
	"net/netip"
	"slices"
	"time"

	"github.com/google/nftables"
)

// sbxID names one generation of a sandbox's elements: every element but
// the sandbox's entry in the sbx map is keyed by it. Its first four bytes
// are the sandbox's denied-ranges profile, the next four its owner's log
// group, the last eight random: a new one is drawn for every attach, policy
// change and adoption, so that elements of an earlier generation (of the
// same sandbox, or of a dead sandbox on the same slot) never match.
type sbxID [16]byte

func newID(profile uint32, group uint16) (sbxID, error) {
	var id sbxID
	binary.BigEndian.PutUint32(id[0:4], profile)
	binary.BigEndian.PutUint32(id[4:8], uint32(group))
	_, err := rand.Read(id[8:])
	return id, err
}

// profileOf names a list of denied ranges: the sandboxes of every process
// with the same configuration share one profile's elements in xdeny. Two
// configurations whose names collide share the union of their ranges
// (each denies more, never less).
func profileOf(spans []span) uint32 {
	h := fnv.New32a()
	var b [8]byte
	for _, s := range spans {
		binary.BigEndian.PutUint32(b[0:4], s.lo)
		binary.BigEndian.PutUint32(b[4:8], s.hi)
		h.Write(b[:])
	}
	return h.Sum32()
}

// Key types. An id is 16 bytes: nft shows it as an IPv6 address.
var (
	typeID         = nftables.TypeIP6Addr
	typeIfAddr     = nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeIPAddr)
	typeIDAddr     = nftables.MustConcatSetType(typeID, nftables.TypeIPAddr)
	typeIDAddrPort = nftables.MustConcatSetType(typeID, nftables.TypeIPAddr, nftables.TypeInetService)
	typeProfAddr   = nftables.MustConcatSetType(nftables.TypeMark, nftables.TypeIPAddr)
	typeAddrProto  = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto)
)

// The shared sets and maps (see the package comment in nft.go).
const (
	setSbx      = "sbx"      // iifname . ip saddr -> id
	setDNSIn    = "dnsin"    // id . gateway . resolver port
	setDNAT     = "dnat"     // id . gateway -> resolver port
	setInternet = "internet" // id (internet mode)
	setXDeny    = "xdeny"    // profile . denied range
	setAllow    = "allow"    // id . range
	setAllowP   = "allowp"   // id . range . port
	setDeny     = "deny"     // id . range (internet mode)
	setDenyP    = "denyp"    // id . range . port (internet mode)
	setNames    = "names"    // id . address an allowed name resolved to (timeout)
	setNamesP   = "namesp"   // id . address . port (timeout)
	setDNames   = "dnames"   // id . address a denied name resolved to
	setLogA     = "loga"     // log group -> jump la<group>
	setLogD     = "logd"     // log group -> jump ld<group>
	setLimA     = "lima"     // meter: allowed connections logged per source
	setLimD     = "limd"     // meter: refusals logged per source
	setDNSLim   = "dnslim"   // meter: DNS packets per source and protocol
	setFlows    = "flows"    // meter: tracked connections per source
	setNewRate  = "newrate"  // meter: new connections a second per source
)

// maxFlows bounds the connections one sandbox has tracked by the host at
// once (closed TCP connections are not counted): the host's conntrack
// table, and its limit (net.netfilter.nf_conntrack_max), are shared by
// the host and every sandbox, and one that is full drops every new
// connection, the daemon's own included. A sandbox past it is refused new
// connections until some of its own end.
const maxFlows = 4096

// A closed TCP connection (TIME_WAIT, CLOSE) stays tracked but is not
// counted (nftables' ct count leaves it out): a sandbox's closed ones leave
// the table after closedTimeout (the kernel's defaults are two minutes and
// ten seconds), and a sandbox opens at most newRate connections a second
// (burst newBurst), so that it holds at most maxFlows open and
// newBurst + newRate*closedTimeout closed ones (4,096 more) at once.
const (
	closedTimeout = 2 // seconds
	newRate       = 1024
	newBurst      = 2048
)

// ctClosed is the shared table's ct timeout object for a sandbox's TCP
// connections (closedTimeout in TIME_WAIT and CLOSE, the kernel's
// defaults otherwise).
const ctClosed = "sbxtcp"

// meterTimeout is how long a meter remembers a source it has not seen
// (each packet renews it: a flood never finds its bucket full again).
const meterTimeout = time.Minute

// meterSize bounds a meter (4,096 slots, two protocols each).
const meterSize = 2 * 2 * maxSlots

func (n *nft) makeSets() {
	t := n.table
	set := func(name string, s nftables.Set) *nftables.Set {
		s.Table, s.Name = t, name
		if len(nftables.ConcatSetTypeElements(s.KeyType)) > 1 {
			s.Concatenation = true
		}
		return &s
	}
	n.sets = map[string]*nftables.Set{
		setSbx:      set(setSbx, nftables.Set{KeyType: typeIfAddr, IsMap: true, DataType: typeID}),
		setDNSIn:    set(setDNSIn, nftables.Set{KeyType: typeIDAddrPort}),
		setDNAT:     set(setDNAT, nftables.Set{KeyType: typeIDAddr, IsMap: true, DataType: nftables.TypeInetService}),
		setInternet: set(setInternet, nftables.Set{KeyType: typeID}),
		setXDeny:    set(setXDeny, nftables.Set{KeyType: typeProfAddr, Interval: true}),
		setAllow:    set(setAllow, nftables.Set{KeyType: typeIDAddr, Interval: true}),
		setAllowP:   set(setAllowP, nftables.Set{KeyType: typeIDAddrPort, Interval: true}),
		setDeny:     set(setDeny, nftables.Set{KeyType: typeIDAddr, Interval: true}),
		setDenyP:    set(setDenyP, nftables.Set{KeyType: typeIDAddrPort, Interval: true}),
		setNames:    set(setNames, nftables.Set{KeyType: typeIDAddr, HasTimeout: true}),
		setNamesP:   set(setNamesP, nftables.Set{KeyType: typeIDAddrPort, HasTimeout: true}),
		setDNames:   set(setDNames, nftables.Set{KeyType: typeIDAddr}),
		setLogA:     set(setLogA, nftables.Set{KeyType: nftables.TypeMark, IsMap: true, DataType: nftables.TypeVerdict}),
		setLogD:     set(setLogD, nftables.Set{KeyType: nftables.TypeMark, IsMap: true, DataType: nftables.TypeVerdict}),
		setLimA:     set(setLimA, nftables.Set{KeyType: nftables.TypeIPAddr, Dynamic: true, HasTimeout: true, Size: meterSize}),
		setLimD:     set(setLimD, nftables.Set{KeyType: nftables.TypeIPAddr, Dynamic: true, HasTimeout: true, Size: meterSize}),
		setDNSLim:   set(setDNSLim, nftables.Set{KeyType: typeAddrProto, Dynamic: true, HasTimeout: true, Size: meterSize}),
		setFlows:    set(setFlows, nftables.Set{KeyType: nftables.TypeIPAddr, Dynamic: true, Size: meterSize}),
		setNewRate:  set(setNewRate, nftables.Set{KeyType: nftables.TypeIPAddr, Dynamic: true, HasTimeout: true, Size: meterSize}),
	}
}

// idSets are the sets whose elements are keyed by an id (first), swept of
// ids no sandbox holds any more.
var idSets = []string{setDNSIn, setDNAT, setInternet, setAllow, setAllowP, setDeny, setDenyP, setNames, setNamesP, setDNames}

// elem is one element of one set.
type elem struct {
	set string
	el  nftables.SetElement
}

func sbxKey(ifname string, ip netip.Addr) []byte {
	b := ip.As4()
	return append(ifKey(ifname), b[:]...)
}

func idAddr(id sbxID, a netip.Addr) []byte {
	b := a.As4()
	return append(id[:], b[:]...)
}

func idAddrPort(id sbxID, a netip.Addr, port uint16) []byte {
	return append(idAddr(id, a), byte(port>>8), byte(port), 0, 0)
}

// staticElements are the elements of a sandbox's policy under id (all but
// its learned addresses and its denied names' addresses).
func staticElements(s *sandboxRules, id sbxID) []elem {
	els := []elem{
		{setDNSIn, nftables.SetElement{Key: idAddrPort(id, s.gateway, s.resolver)}},
		{setDNAT, nftables.SetElement{Key: idAddr(id, s.gateway), Val: []byte{byte(s.resolver >> 8), byte(s.resolver)}}},
	}
	if s.policy.Mode == Internet {
		els = append(els, elem{setInternet, nftables.SetElement{Key: id[:]}})
	}
	els = append(els, rangeElements(id, s.policy.Allow, setAllow, setAllowP)...)
	if s.policy.Mode == Internet {
		els = append(els, rangeElements(id, s.policy.Deny, setDeny, setDenyP)...)
	}
	return els
}

// rangeElements are the range rules of a list, merged per port (the
// interval sets refuse overlapping elements): those without a port in
// plain, the others in withPort.
func rangeElements(id sbxID, rules []Rule, plain, withPort string) []elem {
	byPort := map[uint16][]span{}
	var ports []uint16
	for _, r := range rules {
		if r.Name != "" {
			continue
		}
		if _, ok := byPort[r.Port]; !ok {
			ports = append(ports, r.Port)
		}
		byPort[r.Port] = append(byPort[r.Port], prefixSpan(r.Prefix))
	}
	var out []elem
	for _, p := range ports {
		for _, sp := range merge(byPort[p]) {
			lo, hi := addr(sp.lo), addr(sp.hi)
			if p == 0 {
				out = append(out, elem{plain, nftables.SetElement{Key: idAddr(id, lo), KeyEnd: idAddr(id, hi)}})
			} else {
				out = append(out, elem{withPort, nftables.SetElement{Key: idAddrPort(id, lo, p), KeyEnd: idAddrPort(id, hi, p)}})
			}
		}
	}
	return out
}

// profileElements are a profile's denied ranges.
func profileElements(profile uint32, spans []span) []nftables.SetElement {
	var els []nftables.SetElement
	key := func(a uint32) []byte {
		b := binary.BigEndian.AppendUint32(nil, profile)
		return binary.BigEndian.AppendUint32(b, a)
	}
	for _, s := range spans {
		els = append(els, nftables.SetElement{Key: key(s.lo), KeyEnd: key(s.hi)})
	}
	return els
}

// learnedElements are the elements of learned addresses under id.
func learnedElems(id sbxID, learned []learnedAddr) []elem {
	var out []elem
	for _, l := range learned {
		for _, p := range l.ports {
			if p == 0 {
				out = append(out, elem{setNames, nftables.SetElement{Key: idAddr(id, l.addr), Timeout: l.ttl}})
			} else {
				out = append(out, elem{setNamesP, nftables.SetElement{Key: idAddrPort(id, l.addr, p), Timeout: l.ttl}})
			}
		}
	}
	return out
}

func dnameElems(id sbxID, addrs []netip.Addr) []elem {
	out := make([]elem, 0, len(addrs))
	for _, a := range addrs {
		out = append(out, elem{setDNames, nftables.SetElement{Key: idAddr(id, a)}})
	}
	return out
}

// addElems and delElems queue elements' addition or removal on c, one
// message per set.
// elemsPerMessage bounds the elements of one set message: its element
// list is one netlink attribute, whose length is 16 bits, and a longer
// one wraps (the kernel then saw the first 510 of 2,000 elements with
// timeouts, or 2,048 of 4,000 deletions, and the batch reported success).
// A batch of several messages is still one transaction.
const elemsPerMessage = 256

func (n *nft) addElems(c *nftables.Conn, els []elem) error {
	for _, g := range groupBySet(els) {
		for part := range slices.Chunk(g.els, elemsPerMessage) {
			if err := c.SetAddElements(n.sets[g.set], part); err != nil {
				return err
			}
		}
	}
	return nil
}

func (n *nft) delElems(c *nftables.Conn, els []elem) error {
	keys := make([]elem, 0, len(els))
	for _, e := range els {
		keys = append(keys, elem{e.set, nftables.SetElement{Key: e.el.Key, KeyEnd: e.el.KeyEnd}})
	}
	for _, g := range groupBySet(keys) {
		for part := range slices.Chunk(g.els, elemsPerMessage) {
			if err := c.SetDeleteElements(n.sets[g.set], part); err != nil {
				return err
			}
		}
	}
	return nil
}

type setElems struct {
	set string
	els []nftables.SetElement
}

func groupBySet(els []elem) []setElems {
	var out []setElems
	idx := map[string]int{}
	for _, e := range els {
		i, ok := idx[e.set]
		if !ok {
			i = len(out)
			idx[e.set] = i
			out = append(out, setElems{set: e.set})
		}
		out[i].els = append(out[i].els, e.el)
	}
	return out
}
