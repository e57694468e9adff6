package network

import (
	"fmt"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/cagehq/cage/internal/testutil"
)

// TestHostLinks: the GC's listing of cage<slot> links (a dump of names
// only) finds every link of a slot's name in this namespace, as many as a
// busy host has, and no other (a peer's name, a name that only starts
// like one).
func TestHostLinks(t *testing.T) {
	testutil.RequireRoot(t)
	const first, n = 4000, 150
	var made []netlink.Link
	t.Cleanup(func() {
		for _, l := range made {
			_ = netlink.LinkDel(l)
		}
	})
	for i := range n {
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: ifName(first + i)}, PeerName: fmt.Sprintf("peer%d", first+i)}
		if err := netlink.LinkAdd(v); err != nil {
			t.Fatal(err)
		}
		made = append(made, v)
	}
	for i, name := range []string{"cage012", "cagex", "cage-3"} {
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: fmt.Sprintf("odd%d", i)}
		if err := netlink.LinkAdd(d); err != nil {
			t.Fatal(err)
		}
		made = append(made, d)
	}
	got := hostLinks()
	slices.Sort(got)
	var want []int
	for i := range n {
		want = append(want, first+i)
	}
	if !slices.Equal(got, want) {
		t.Errorf("hostLinks: %d slots %v, want the %d made (%d..%d)", len(got), got, n, first, first+n-1)
	}
	names, err := linkNames()
	if err != nil || !slices.Contains(names, "lo") || !slices.Contains(names, "peer4000") || !slices.Contains(names, "cage-3") {
		t.Errorf("linkNames: %v (%d names), want lo, the peers and the dummies too", err, len(names))
	}
}

func TestSlotOf(t *testing.T) {
	for name, want := range map[string]int{"cage0": 0, "cage7": 7, "cage4095": 4095} {
		if got, ok := slotOf(name); !ok || got != want {
			t.Errorf("slotOf(%q) = %d %v, want %d", name, got, ok, want)
		}
	}
	for _, name := range []string{"cage", "cage012", "cage-3", "cage+3", "cage3x", "xcage3", "lo", "cage 3"} {
		if got, ok := slotOf(name); ok {
			t.Errorf("slotOf(%q) = %d, want none", name, got)
		}
	}
}
