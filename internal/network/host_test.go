package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// Attack: anyone who reaches the host's other addresses (its uplink here)
// talks to the sandboxes' resolver. Expected: it listens on the gateway
// address only, so nothing answers on the uplink.
func TestResolverListensOnGatewayOnly(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	if got := h.res.udp.PacketConn.LocalAddr().String(); got != netip.AddrPortFrom(h.gateway, h.res.port).String() {
		t.Errorf("the resolver's UDP socket is bound to %s, want the gateway", got)
	}
	if got := h.res.tcp.Listener.Addr().String(); got != netip.AddrPortFrom(h.gateway, h.res.port).String() {
		t.Errorf("the resolver's TCP socket is bound to %s, want the gateway", got)
	}
	at := netip.AddrPortFrom(w.HostHTTP.Addr(), h.res.port).String()
	err := testutil.InNS(w.Public, func() error {
		c, err := net.DialTimeout("tcp4", at, 2*time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
	if err == nil {
		t.Errorf("the resolver's port answers on the host's uplink %s", at)
	}
	// And sandboxes still resolve.
	s := attach(t, h, Policy{Mode: Internet})
	if ans, err := s.lookup(h.Gateway().String()+":53", "www.example.com", false); err != nil || len(addrsOf(ans)) != 1 {
		t.Errorf("resolve through the gateway: %v %v", ans, err)
	}
}

// Attack: another table on the host redirects a sandbox's connection to a
// host service (an admin's transparent proxy rule, say). Expected: cage's
// input chain accepts only its own DNS redirect, so the sandbox is refused.
func TestInputAcceptsOnlyCageDNAT(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, Policy{Mode: Internet})
	l, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprint(c, "HTTP/1.0 200 OK\r\n\r\nhost service")
			c.Close()
		}
	}()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	accept := nftables.ChainPolicyAccept
	tb := c.AddTable(&nftables.Table{Name: "othernat", Family: nftables.TableFamilyIPv4})
	ch := c.AddChain(&nftables.Chain{Name: "pre", Table: tb, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest, Policy: &accept})
	c.AddRule(&nftables.Rule{Table: tb, Chain: ch, Exprs: cat(ifnamePrefix(expr.MetaKeyIIFNAME, true), l4proto(unix.IPPROTO_TCP), dport(7777),
		[]expr.Any{&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
			&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED}})})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.DelTable(tb); _ = c.Flush() })
	if body, err := s.get(h.Gateway().String() + ":7777"); err == nil {
		t.Errorf("a host service another table redirected the sandbox to answers: %q", body)
	}
	if ans, err := s.lookup(h.Gateway().String()+":53", "www.example.com", true); err != nil || len(addrsOf(ans)) != 1 {
		t.Errorf("cage's own redirect (DNS over TCP): %v %v", ans, err)
	}
}

// lanHost makes a namespace "lan" joined to this one by a veth (not one of
// cage's), 198.51.100.2 routed through 198.51.100.1 here, and a route back
// to it from the world: the host can route between the LAN and the world.
func lanHost(t *testing.T, w *testutil.World) netns.NsHandle {
	t.Helper()
	ns := namespaces(t, 1)[0]
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "lan0"}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = netlink.LinkDel(veth) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	here, err := netlink.LinkByName("lan0")
	must(err)
	must(netlink.AddrAdd(here, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(198, 51, 100, 1), Mask: net.CIDRMask(24, 32)}}))
	must(netlink.LinkSetUp(here))
	must(testutil.InNS(ns, func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(eth0, &netlink.Addr{IPNet: &net.IPNet{IP: net.IPv4(198, 51, 100, 2), Mask: net.CIDRMask(24, 32)}}); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(eth0); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{Gw: net.IPv4(198, 51, 100, 1)})
	}))
	back := &netlink.Route{Dst: &net.IPNet{IP: net.IPv4(198, 51, 100, 0), Mask: net.CIDRMask(24, 32)}, Gw: w.HostHTTP.Addr().AsSlice()}
	must(testutil.InNS(w.Public, func() error { return netlink.RouteAdd(back) }))
	t.Cleanup(func() { _ = testutil.InNS(w.Public, func() error { return netlink.RouteDel(back) }) })
	return ns
}

// lanGet fetches the public host from the LAN namespace (the dial is made
// on the calling thread, which InNS moved there).
func lanGet(lan netns.NsHandle) (string, error) {
	return (&fakeSandbox{ns: lan}).get(testutil.PublicHost.String() + ":80")
}

// resetForwarding removes the table (no Host of this process is alive) and
// sets IPv4 forwarding as a host would have it before cage.
func resetForwarding(t *testing.T, on bool) {
	t.Helper()
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	c.DelTable(&nftables.Table{Name: tableName, Family: nftables.TableFamilyINet})
	_ = c.Flush()
	v := "0"
	if on {
		v = "1"
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte(v), 0); err != nil {
		t.Fatal(err)
	}
}

// Attack: on a host that did not route, cage turns IPv4 forwarding on for
// its sandboxes; a machine on another of the host's networks (the LAN here)
// then routes through the host to the world. Expected: where cage turned
// forwarding on, forwarded traffic that is not a sandbox's is dropped;
// where the admin had it on, cage leaves the host's routing alone; the
// sandboxes reach the world either way; cage doctor says which.
func TestForwardingGuard(t *testing.T) {
	w := testutil.NewWorld(t)
	lan := lanHost(t, w)
	t.Cleanup(func() { resetForwarding(t, false) })

	resetForwarding(t, false)
	h := newHost(t, w, nil)
	if body, err := lanGet(lan); err == nil {
		t.Errorf("cage turned forwarding on and the host routes the LAN to the world: %q", body)
	}
	s := attach(t, h, Policy{Mode: Internet})
	if body, err := s.get(testutil.PublicHost.String() + ":80"); err != nil || !strings.HasPrefix(body, "public") {
		t.Errorf("a sandbox behind the guard: %q %v", body, err)
	}
	if !strings.Contains(forwardingFinding(), "drops") {
		t.Errorf("doctor does not say that cage drops other forwarding: %q", forwardingFinding())
	}
	// A second process (another cage run) keeps the guard.
	h2 := newHost(t, w, nil)
	if !h2.nft.forwardGuarded() {
		t.Error("a second cage process lifted the guard")
	}
	if body, err := lanGet(lan); err == nil {
		t.Errorf("after a second cage process started, the LAN is routed: %q", body)
	}
	h2.Close()
	h.Close()

	resetForwarding(t, true)
	h3 := newHost(t, w, nil)
	if h3.nft.forwardGuarded() {
		t.Error("forwarding was on before cage, and cage guards it")
	}
	if body, err := lanGet(lan); err != nil || !strings.HasPrefix(body, "public") {
		t.Errorf("forwarding the admin had on is broken: %q %v", body, err)
	}
	if !strings.Contains(forwardingFinding(), "was on before") {
		t.Errorf("doctor: %q", forwardingFinding())
	}
}

func forwardingFinding() string {
	for _, f := range Readiness(nil) {
		if f.Name == "ip forwarding" {
			return f.Info
		}
	}
	return ""
}

// Attack: a sandbox floods the resolver with questions from one socket (so
// that after the first answer the host tracks the flow as established).
// Expected: the kernel lets through at most the sandbox's DNS packet rate;
// the resolver (and the records) see no more than that.
func TestDNSFloodBoundedBeforeTheResolver(t *testing.T) {
	w := testutil.NewWorld(t)
	rec := &recorder{}
	h := newHost(t, w, rec)
	s := attach(t, h, Policy{Mode: Internet})
	var sent int
	start := time.Now()
	err := testutil.InNS(s.ns, func() error {
		// Unconnected: the ICMP errors of refused packets must not fail
		// (and so slow) the next writes, as they do on a connected socket.
		c, err := net.ListenPacket("udp4", ":0")
		if err != nil {
			return err
		}
		defer c.Close()
		to := &net.UDPAddr{IP: h.Gateway().AsSlice(), Port: 53}
		q := new(dns.Msg).SetQuestion("www.example.com.", dns.TypeA)
		b, _ := q.Pack()
		// One answered question first: until the gateway's neighbour entry
		// resolves, the kernel queues the flood and blocks the writer.
		buf := make([]byte, 1500)
		for i := 0; ; i++ {
			_, _ = c.WriteTo(b, to)
			_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if _, _, err := c.ReadFrom(buf); err == nil {
				break
			}
			if i == 50 {
				return errors.New("the resolver never answered")
			}
		}
		start = time.Now()
		for time.Since(start) < time.Second {
			if _, err := c.WriteTo(b, to); err == nil {
				sent++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	time.Sleep(500 * time.Millisecond) // what got through is answered
	rec.mu.Lock()
	seen := 0
	for _, r := range rec.rs {
		if r.Kind == "dns" && r.Sandbox == s.net.ID {
			seen++
		}
	}
	rec.mu.Unlock()
	bound := dnsBurst + int(dnsPackets*elapsed.Seconds()) + 50
	t.Logf("%d questions sent in %v; the resolver saw %d (bound %d)", sent, elapsed, seen, bound)
	if sent < 4*bound {
		t.Fatalf("only %d questions sent: too few to test a bound of %d", sent, bound)
	}
	if seen > bound || seen == 0 {
		t.Errorf("the resolver saw %d of %d questions; want 1 to %d", seen, sent, bound)
	}
}

// cage doctor's probe of the kernel's connection bounds (nft_connlimit,
// conntrack timeout policies) finds them on a kernel that has them (this
// suite's rules need both) and leaves no table behind.
func TestRuleFeaturesProbe(t *testing.T) {
	testutil.RequireRoot(t)
	f := ruleFeatures()
	if !f.OK {
		t.Errorf("doctor's connection bounds: %+v; want ok on a kernel the network tests pass on", f)
	}
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range tables {
		if strings.HasPrefix(tb.Name, "cage_probe") {
			t.Errorf("the probe left table inet %s", tb.Name)
		}
	}
}
