package network

import (
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/cagehq/cage/internal/testutil"
)

// A fresh sandbox sends at once (an agent's first DNS question comes
// milliseconds after its create). Each end of its pair sends only once the
// kernel's link watcher has given it its queue; before, what it sends is
// dropped, and the host's answer to the sandbox's first ARP request was:
// the sandbox asked again a second later (9 of 100 fresh sandboxes under a
// test suite's load), so its first question waited that second, or was
// lost to a one-second timeout. Expected: Attach returns once both ends
// can send: the first exchanges of 50 fresh sandboxes drop nothing at
// either end.
func TestFreshPairDropsNothing(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	udpEcho(t, w, 7400)
	for i := range 50 {
		ns := namespaces(t, 1)
		nextSlot++
		sb, err := h.Attach("fresh", nextSlot, int(ns[0]), Policy{Mode: Internet})
		if err != nil {
			t.Fatal(err)
		}
		s := &fakeSandbox{ns: ns[0], net: sb}
		var r string
		for range 5 {
			if r, err = s.exchange(42000+i, 7400, "x"); err == nil {
				break
			}
		}
		if err != nil || r != "echo x" {
			t.Fatalf("sandbox %d: its exchange: %q, %v", i, r, err)
		}
		host, err := netlink.LinkByName(ifName(sb.Slot))
		if err != nil {
			t.Fatal(err)
		}
		var inside *netlink.LinkStatistics
		if err := testutil.InNS(ns[0], func() error {
			l, err := netlink.LinkByName("eth0")
			if err == nil {
				inside = l.Attrs().Statistics
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if d := host.Attrs().Statistics.TxDropped; d != 0 {
			t.Errorf("sandbox %d: the host end dropped %d packets to it before it could send", i, d)
		}
		if d := inside.TxDropped; d != 0 {
			t.Errorf("sandbox %d: its eth0 dropped %d of its packets before it could send", i, d)
		}
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
