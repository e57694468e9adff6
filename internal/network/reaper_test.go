package network

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// ctEntry makes a tracked UDP connection src:sport -> dst:53 whose reply
// comes from rsrc to rdst.
func ctEntry(t testing.TB, src, dst, rsrc, rdst string, sport uint16) {
	t.Helper()
	cf := &netlink.ConntrackFlow{
		FamilyType: unix.AF_INET,
		Forward:    netlink.IPTuple{SrcIP: v4(src), DstIP: v4(dst), SrcPort: sport, DstPort: 53, Protocol: unix.IPPROTO_UDP},
		Reverse:    netlink.IPTuple{SrcIP: v4(rsrc), DstIP: v4(rdst), SrcPort: 53, DstPort: sport, Protocol: unix.IPPROTO_UDP},
		TimeOut:    300,
	}
	if err := netlink.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, cf); err != nil {
		t.Fatalf("making the entry %s>%s: %v", src, dst, err)
	}
}

// ctLeft is the table's entries as "src>dst" of their original direction.
func ctLeft(t testing.TB) map[string]bool {
	t.Helper()
	all, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range all {
		have[f.Forward.SrcIP.String()+">"+f.Forward.DstIP.String()] = true
	}
	return have
}

// TestForgetBatch: ends forgotten together, by one walk of the table or
// by each address's filtered dumps, forget every connection of each
// address, wherever it is in the entry (its own, to it, translated either
// way), and leave every other (another sandbox's, an address with the
// same first digits). Expected: the same outcome both ways.
func TestForgetBatch(t *testing.T) {
	testutil.RequireRoot(t)
	for _, walk := range []bool{true, false} {
		t.Run(fmt.Sprintf("walk=%v", walk), func(t *testing.T) {
			if err := netlink.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
				t.Fatal(err)
			}
			mine := []string{"10.77.1.5", "10.77.1.6", "10.77.1.7"}
			type e struct {
				src, dst, rsrc, rdst string
				theirs               bool
			}
			var made []e
			for i, me := range mine {
				made = append(made,
					e{me, "192.0.2.1", "192.0.2.1", "203.0.113.1", true},                               // its own, masqueraded
					e{"10.200.0.1", me, me, "10.200.0.1", true},                                        // to it
					e{"192.0.2.9", fmt.Sprintf("198.51.100.%d", i+1), me, "192.0.2.9", true},           // translated to it
					e{"192.0.2.7", fmt.Sprintf("198.51.100.%d", i+11), "198.51.100.2", me, true},       // translated from it
					e{fmt.Sprintf("10.77.1.%d", 50+i), "192.0.2.1", "192.0.2.1", "203.0.113.1", false}, // a longer address
					e{fmt.Sprintf("10.77.2.%d", 5+i), "192.0.2.1", "192.0.2.1", "203.0.113.1", false},  // another's
				)
			}
			for i, x := range made {
				ctEntry(t, x.src, x.dst, x.rsrc, x.rdst, uint16(4000+i))
			}
			var addrs []netip.Addr
			for _, me := range mine {
				addrs = append(addrs, netip.MustParseAddr(me))
			}
			for ip, err := range forgetBatch(addrs, walk) {
				if err != nil {
					t.Errorf("forget %s: %v", ip, err)
				}
			}
			have := ctLeft(t)
			for _, x := range made {
				if k := x.src + ">" + x.dst; have[k] == x.theirs {
					t.Errorf("the entry %s (reply %s>%s): left %v, want %v", k, x.rsrc, x.rdst, have[k], !x.theirs)
				}
			}
		})
	}
}

// TestForgetFlowsAtOnce: many ends at once (a key's sandboxes killed
// together) each return only once their own connections are gone, and
// nobody else's go. Expected: after every forgetFlows has returned, none
// of the ended addresses' entries is left and every other is.
func TestForgetFlowsAtOnce(t *testing.T) {
	testutil.RequireRoot(t)
	if err := netlink.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		ctEntry(t, fmt.Sprintf("10.77.3.%d", i+1), "192.0.2.1", "192.0.2.1", "203.0.113.1", uint16(5000+i))
		ctEntry(t, "10.200.0.1", fmt.Sprintf("10.77.3.%d", i+1), fmt.Sprintf("10.77.3.%d", i+1), "10.200.0.1", uint16(6000+i))
		ctEntry(t, fmt.Sprintf("10.77.4.%d", i+1), "192.0.2.1", "192.0.2.1", "203.0.113.1", uint16(7000+i))
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ip := netip.MustParseAddr(fmt.Sprintf("10.77.3.%d", i+1))
			if err := forgetFlows(ip); err != nil {
				t.Errorf("forget %s: %v", ip, err)
			}
			// Returned: its own are gone now, whatever the others' batch.
			for k := range ctLeft(t) {
				if k == ip.String()+">192.0.2.1" || k == "10.200.0.1>"+ip.String() {
					t.Errorf("%s's entry %s is left after its forgetFlows returned", ip, k)
				}
			}
		}()
	}
	wg.Wait()
	have := ctLeft(t)
	for i := range n {
		if k := fmt.Sprintf("10.77.4.%d>192.0.2.1", i+1); !have[k] {
			t.Errorf("another sandbox's entry %s was forgotten", k)
		}
	}
}

// TestWalkCheaper: the choice between one walk and the filtered dumps
// follows the measured costs (see reaper.go), and an unknown table keeps
// the filtered dumps.
func TestWalkCheaper(t *testing.T) {
	for _, c := range []struct {
		batch, entries, buckets int
		want                    bool
	}{
		{1, 200, 262144, true},    // a few entries: one walk against four
		{1, 20000, 262144, false}, // many: four filtered walks cost less than decoding them
		{8, 20000, 262144, true},  // many ends at once: one walk for all
		{1, -1, 262144, false},    // unknown count
		{1, 200, -1, false},       // unknown size
		{2, 3500, 262144, true},   // (4*2-1)*1024 = 7168 > 3500
		{2, 8000, 262144, false},
	} {
		if got := walkCheaper(c.batch, c.entries, c.buckets); got != c.want {
			t.Errorf("walkCheaper(%d, %d, %d) = %v, want %v", c.batch, c.entries, c.buckets, got, c.want)
		}
	}
}

// BenchmarkForgetFlowsAtOnce: 16 ends at once with the table holding
// other sandboxes' entries (-others: 2,000), batched (as forgetFlows
// does) against each alone by the kernel's filtered dumps (the peer, same
// run); per end.
func BenchmarkForgetFlowsAtOnce(b *testing.B) {
	testutil.RequireRoot(b)
	if err := netlink.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
		b.Fatal(err)
	}
	for i := range 2000 {
		src := fmt.Sprintf("10.78.%d.%d", i>>8, i&255)
		ctEntry(b, src, "192.0.2.1", "192.0.2.1", src, 4000)
	}
	const ends = 16
	addr := func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("10.77.5.%d", i+1)) }
	mine := func() {
		for i := range ends {
			ctEntry(b, addr(i).String(), "192.0.2.1", "192.0.2.1", addr(i).String(), 5000)
		}
	}
	run := func(b *testing.B, forget func(netip.Addr) error) {
		for b.Loop() {
			b.StopTimer()
			mine()
			b.StartTimer()
			var wg sync.WaitGroup
			for i := range ends {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := forget(addr(i)); err != nil {
						b.Error(err)
					}
				}()
			}
			wg.Wait()
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*ends)/1e6, "ms/end")
	}
	b.Run("batched", func(b *testing.B) { run(b, forgetFlows) })
	b.Run("alone", func(b *testing.B) { run(b, forgetOne) })
}
