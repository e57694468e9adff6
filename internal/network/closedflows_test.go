package network

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// trackedFrom counts the host's conntrack entries whose original source is
// a (every state, closed TCP connections included), and whose original
// destination is to, if to is valid.
func trackedFrom(t *testing.T, a, to netip.Addr) int {
	t.Helper()
	flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range flows {
		src, _ := netip.AddrFromSlice(f.Forward.SrcIP)
		dst, _ := netip.AddrFromSlice(f.Forward.DstIP)
		if src.Unmap() == a && (!to.IsValid() || dst.Unmap() == to) {
			n++
		}
	}
	return n
}

// Attack: a sandbox with internet opens TCP connections to a server
// outside and closes each at once. A closed connection stays in the host's
// conntrack table (TIME_WAIT, two minutes by default) but is not counted
// against the sandbox's bound of tracked connections, so the sandbox goes
// on opening new ones: the table, shared by the host and every sandbox,
// fills with them. Expected: the host keeps at most maxFlows entries of the
// sandbox's at once, closed ones included.
func TestClosedFlowsBounded(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Internet})
	const port = 7400
	var l net.Listener
	if err := testutil.InNS(w.Public, func() (err error) {
		l, err = net.Listen("tcp4", fmt.Sprintf("%s:%d", testutil.PublicHost, port))
		return
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	const tries = maxFlows + 1500
	opened := 0
	start := time.Now()
	err := testutil.InNS(a.ns, func() error {
		to := &net.TCPAddr{IP: testutil.PublicHost.AsSlice(), Port: port}
		for range tries {
			c, err := net.DialTCP("tcp4", nil, to)
			if err != nil {
				continue
			}
			opened++
			// A reset, not a FIN: no TIME_WAIT at the sandbox's end, so
			// its ports never run out; the host's entry still closes.
			_ = c.SetLinger(0)
			c.Close()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	n := trackedFrom(t, a.net.IP, netip.Addr{})
	t.Logf("%d of %d connections opened and closed in %v; the host tracks %d of the sandbox's", opened, tries, time.Since(start).Round(time.Millisecond), n)
	if n > maxFlows {
		t.Errorf("the host tracks %d entries of one sandbox; want at most %d", n, maxFlows)
	}
	// The same for its closed TCP connections to the resolver (which its
	// DNS packet rate paces, but which stayed two minutes each): gone
	// within closedTimeout.
	time.Sleep((closedTimeout + 1) * time.Second)
	err = testutil.InNS(a.ns, func() error {
		to := &net.TCPAddr{IP: h.Gateway().AsSlice(), Port: 53}
		for range 20 {
			c, err := net.DialTCP("tcp4", nil, to)
			if err != nil {
				return err
			}
			c.Close()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep((closedTimeout + 1) * time.Second)
	if n := trackedFrom(t, a.net.IP, h.Gateway()); n > 0 {
		t.Errorf("%d of the sandbox's connections to the resolver still tracked %ds after they closed", n, closedTimeout+1)
	}
}
