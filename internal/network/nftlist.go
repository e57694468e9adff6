package network

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
)

// Listing the shared sets: what GC, the checks for leftovers and the tests
// read back from the table.

// sbxEntry is one entry of the sbx map.
type sbxEntry struct {
	slot int // -1 for an interface not named cage<slot>
	key  []byte
	id   sbxID
}

// entries lists the sbx map (the caller holds mu).
func (n *nft) entries() ([]sbxEntry, error) {
	els, err := n.conn.GetSetElements(n.sets[setSbx])
	if err != nil {
		return nil, err
	}
	out := make([]sbxEntry, 0, len(els))
	for _, e := range els {
		if len(e.Key) < 20 || len(e.Val) < len(sbxID{}) {
			continue
		}
		slot := -1
		name := strings.TrimRight(string(e.Key[:16]), "\x00")
		if v, err := strconv.Atoi(strings.TrimPrefix(name, ifPrefix)); err == nil && ifName(v) == name {
			slot = v
		}
		out = append(out, sbxEntry{slot: slot, key: e.Key, id: sbxID(e.Val[:16])})
	}
	return out, nil
}

// elements lists the addresses of a sandbox's current generation in one of
// the sets ("n": learned, "p": learned with a port, "y": denied names'),
// for tests and checks.
func (n *nft) elements(slot int, which string) ([]netip.Addr, error) {
	name := map[string]string{"n": setNames, "p": setNamesP, "y": setDNames}[which]
	if name == "" {
		return nil, fmt.Errorf("no set %q", which)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	entries, err := n.entries()
	if err != nil {
		return nil, err
	}
	var ids []sbxID
	for _, e := range entries {
		if e.slot == slot {
			ids = append(ids, e.id)
		}
	}
	els, err := n.conn.GetSetElements(n.sets[name])
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, e := range els {
		if len(e.Key) >= 20 && slices.Contains(ids, sbxID(e.Key[:16])) {
			out = append(out, netip.AddrFrom4([4]byte(e.Key[16:20])))
		}
	}
	return out, nil
}

// slots lists the sandbox slots that have an entry in the table.
func (n *nft) slots() ([]int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	entries, err := n.entries()
	if err != nil {
		if isNotFound(err) {
			return nil, nil // no table
		}
		return nil, err
	}
	var out []int
	for _, e := range entries {
		if e.slot >= 0 {
			out = append(out, e.slot)
		}
	}
	return out, nil
}

// sweep removes the elements of ids no sbx entry holds (a dead owner's, a
// generation replaced by another process) and says how many. The elements
// are listed before the entries: an id no entry holds then never will again.
func (n *nft) sweep() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	lists := map[string][]nftables.SetElement{}
	for _, name := range idSets {
		els, err := n.conn.GetSetElements(n.sets[name])
		if err != nil {
			return 0
		}
		lists[name] = els
	}
	entries, err := n.entries()
	if err != nil {
		return 0
	}
	live := map[sbxID]bool{}
	for _, e := range entries {
		live[e.id] = true
	}
	swept := 0
	for _, name := range idSets {
		var dead []elem
		for _, e := range lists[name] {
			if len(e.Key) >= 16 && !e.IntervalEnd && !live[sbxID(e.Key[:16])] {
				dead = append(dead, elem{name, e})
			}
		}
		if len(dead) == 0 {
			continue
		}
		if n.delElems(n.conn, dead) == nil && n.conn.Flush() == nil {
			swept += len(dead)
			continue
		}
		for _, d := range dead { // some expired meanwhile
			if n.delElems(n.conn, []elem{d}) == nil && n.conn.Flush() == nil {
				swept++
			}
		}
	}
	return swept
}
