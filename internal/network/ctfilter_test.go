package network

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// A sandbox's end forgets the connections of its address wherever the
// address is in them: the source or destination of the original direction
// (its own connections; the proxy's to it), or of the reply (translated
// ones). Expected: the kernel's filtered dumps find each such entry and
// they are deleted, and every other entry is left, an address with the
// same first digits included (10.77.0.50 is not 10.77.0.5).
func TestForgetFlowsByKernel(t *testing.T) {
	testutil.RequireRoot(t)
	type flow struct {
		name                   string
		src, dst, rsrc, rdst   string
		sport, dport, rsp, rdp uint16
		proto                  uint8
		theirs                 bool
	}
	const me = "10.77.0.5"
	flows := []flow{
		{"its own", me, "192.0.2.1", "192.0.2.1", "203.0.113.1", 4000, 53, 53, 4000, unix.IPPROTO_UDP, true},
		{"to it", "10.200.0.1", me, me, "10.200.0.1", 5000, 49983, 49983, 5000, unix.IPPROTO_TCP, true},
		{"translated to it", "192.0.2.9", "198.51.100.1", me, "192.0.2.9", 6000, 80, 80, 6000, unix.IPPROTO_UDP, true},
		{"translated from it", "192.0.2.7", "198.51.100.2", "198.51.100.2", me, 7000, 80, 80, 7000, unix.IPPROTO_UDP, true},
		{"another's", "10.77.0.6", "192.0.2.1", "192.0.2.1", "203.0.113.1", 4001, 53, 53, 4001, unix.IPPROTO_UDP, false},
		{"a longer address", "10.77.0.50", "192.0.2.1", "192.0.2.1", "203.0.113.1", 4002, 53, 53, 4002, unix.IPPROTO_UDP, false},
		{"to another", "10.200.0.1", "10.77.0.51", "10.77.0.51", "10.200.0.1", 5001, 49983, 49983, 5001, unix.IPPROTO_TCP, false},
	}
	key := func(f *netlink.ConntrackFlow) string {
		return f.Forward.SrcIP.String() + ">" + f.Forward.DstIP.String()
	}
	for _, f := range flows {
		cf := &netlink.ConntrackFlow{
			FamilyType: unix.AF_INET,
			Forward:    netlink.IPTuple{SrcIP: v4(f.src), DstIP: v4(f.dst), SrcPort: f.sport, DstPort: f.dport, Protocol: f.proto},
			Reverse:    netlink.IPTuple{SrcIP: v4(f.rsrc), DstIP: v4(f.rdst), SrcPort: f.rsp, DstPort: f.rdp, Protocol: f.proto},
			TimeOut:    300,
		}
		if f.proto == unix.IPPROTO_TCP {
			cf.ProtoInfo = &netlink.ProtoInfoTCP{State: 3} // ESTABLISHED
		}
		if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, cf); err != nil {
			t.Fatalf("making the %s entry: %v", f.name, err)
		}
	}
	if all, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET); err != nil || len(all) < len(flows) {
		t.Fatalf("the table holds %d entries (%v), want at least the %d made", len(all), err, len(flows))
	}
	n, err := deleteFlowsByKernel(netip.MustParseAddr(me))
	if err != nil {
		t.Fatalf("deleteFlowsByKernel: %v (the kernel filters conntrack dumps since Linux 5.8)", err)
	}
	if n != 4 {
		t.Errorf("deleted %d entries, want 4", n)
	}
	left, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range left {
		have[key(f)] = true
	}
	for _, f := range flows {
		k := f.src + ">" + f.dst
		if have[k] == f.theirs {
			t.Errorf("the %s entry (%s): left %v, want %v", f.name, k, have[k], !f.theirs)
		}
	}
	// Nothing left to find: a second pass deletes nothing.
	if n, err := deleteFlowsByKernel(netip.MustParseAddr(me)); err != nil || n != 0 {
		t.Errorf("a second pass: deleted %d, %v; want 0, nil", n, err)
	}
}

// v4 is an address as conntrack's tuples take it: four bytes.
func v4(s string) net.IP { return net.ParseIP(s).To4() }

// BenchmarkForgetFlows: a sandbox's end with the host's table holding
// other sandboxes' entries (-flows, default 20,000), the kernel choosing
// the address's entries against this process walking the whole table as
// before (the peer, same run).
func BenchmarkForgetFlows(b *testing.B) {
	testutil.RequireRoot(b)
	if err := netlink.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
		b.Fatal(err)
	}
	const others = 20000
	for i := range others {
		src := net.IPv4(10, 78, byte(i>>8), byte(i)).To4()
		cf := &netlink.ConntrackFlow{
			FamilyType: unix.AF_INET,
			Forward:    netlink.IPTuple{SrcIP: src, DstIP: v4("192.0.2.1"), SrcPort: 4000, DstPort: 53, Protocol: unix.IPPROTO_UDP},
			Reverse:    netlink.IPTuple{SrcIP: v4("192.0.2.1"), DstIP: src, SrcPort: 53, DstPort: 4000, Protocol: unix.IPPROTO_UDP},
			TimeOut:    600,
		}
		if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, cf); err != nil {
			b.Fatal(err)
		}
	}
	me := netip.MustParseAddr("10.77.0.5")
	mine := func() {
		for p := range 4 {
			cf := &netlink.ConntrackFlow{
				FamilyType: unix.AF_INET,
				Forward:    netlink.IPTuple{SrcIP: v4(me.String()), DstIP: v4("192.0.2.1"), SrcPort: uint16(5000 + p), DstPort: 53, Protocol: unix.IPPROTO_UDP},
				Reverse:    netlink.IPTuple{SrcIP: v4("192.0.2.1"), DstIP: v4(me.String()), SrcPort: 53, DstPort: uint16(5000 + p), Protocol: unix.IPPROTO_UDP},
				TimeOut:    600,
			}
			if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, cf); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("kernel", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			mine()
			b.StartTimer()
			if n, err := deleteFlowsByKernel(me); err != nil || n != 4 {
				b.Fatalf("deleted %d, %v", n, err)
			}
		}
	})
	b.Run("walk", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			mine()
			b.StartTimer()
			if n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, addrFilter{me}); err != nil || n != 4 {
				b.Fatalf("deleted %d, %v", n, err)
			}
		}
	})
}
