package testutil

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Network tests never reach the internet: the test binary runs in a network
// namespace of its own (the "host" cage sees), and NewWorld builds an
// "outside" in another namespace, joined to it by a veth: public hosts
// with HTTP servers, an upstream DNS server with a small zone, and a second
// resolver that nothing should reach. Cloud metadata servers and a service
// of the host itself listen in the test's own namespace.

const ownNetnsEnv = "CAGE_TEST_OWN_NETNS"

// InOwnNetwork runs the tests (call it from TestMain) in a network namespace
// of their own when run as root, so that what they do to the network (the
// nftables table, forwarding, addresses) stays there and goes with them.
func InOwnNetwork(m *testing.M) int {
	if os.Getenv(ownNetnsEnv) == "1" {
		if err := linkUp("lo"); err != nil {
			fmt.Fprintln(os.Stderr, "loopback:", err)
			return 1
		}
		return m.Run()
	}
	if os.Geteuid() != 0 {
		return m.Run() // the tests that need root skip themselves
	}
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Env = append(os.Environ(), ownNetnsEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "run the tests in their own network namespace:", err)
		return 1
	}
	return 0
}

// InOwnNetns reports whether this test process runs in its own network namespace.
func InOwnNetns() bool { return os.Getenv(ownNetnsEnv) == "1" }

func linkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	return netlink.LinkSetUp(l)
}

// Addresses of the outside world.
var (
	PublicHost   = netip.MustParseAddr("93.184.216.34") // allowed.example.com, www/api.example.com
	OtherHost    = netip.MustParseAddr("93.184.216.35") // other.example.org
	UpstreamDNS  = netip.MustParseAddr("9.9.9.9")       // the resolver cage is configured with
	ForeignDNS   = netip.MustParseAddr("8.8.8.8")       // a resolver sandboxes must not reach
	uplinkHost   = netip.MustParsePrefix("192.0.2.2/24")
	uplinkPublic = netip.MustParsePrefix("192.0.2.1/24")
	// MetadataAddrs are cloud metadata services: the first in the test's own
	// namespace, the others outside.
	MetadataAddrs = []netip.Addr{netip.MustParseAddr("169.254.169.254"), netip.MustParseAddr("100.100.100.200"), netip.MustParseAddr("168.63.129.16")}
)

// Zone is the upstream DNS server's zone.
var Zone = map[string]netip.Addr{
	"allowed.example.com":      PublicHost,
	"www.example.com":          PublicHost,
	"api.example.com":          PublicHost,
	"other.example.org":        OtherHost,
	"rebind.example.org":       MetadataAddrs[0],
	"metadata.google.internal": MetadataAddrs[0],
}

// World is the outside a network test made.
type World struct {
	Public   netns.NsHandle
	HostHTTP netip.AddrPort // a service of the host itself (on its uplink address)
	HostLo   netip.AddrPort // and one on its loopback

	mu       sync.Mutex
	upstream []string // names the upstream resolver was asked
	foreign  []string // names the foreign resolver was asked
	hits     map[string]int
	closers  []func()
}

// NewWorld builds the outside for one test. It needs root and InOwnNetwork.
func NewWorld(t testing.TB) *World {
	t.Helper()
	w := newWorld(t)
	t.Cleanup(w.close)
	return w
}

var shared struct {
	sync.Mutex
	w *World
}

// SharedWorld is one outside for every test of the binary that asks for it
// (it goes with the test process and its namespace).
func SharedWorld(t testing.TB) *World {
	t.Helper()
	shared.Lock()
	defer shared.Unlock()
	if shared.w == nil {
		shared.w = newWorld(t)
	}
	return shared.w
}

func newWorld(t testing.TB) *World {
	t.Helper()
	RequireRoot(t)
	if !InOwnNetns() {
		t.Skip("network tests run in a network namespace of their own (TestMain must call testutil.InOwnNetwork)")
	}
	w := &World{hits: map[string]int{}}
	pub, err := newNS()
	if err != nil {
		t.Fatal(err)
	}
	w.Public = pub
	w.closers = append(w.closers, func() { pub.Close() })
	// The uplink: up0 here, wan0 there.
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up0"}, PeerName: "wan0", PeerNamespace: netlink.NsFd(int(pub))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatal("uplink:", err)
	}
	w.closers = append(w.closers, func() { _ = netlink.LinkDel(veth) })
	must := func(err error) {
		t.Helper()
		if err != nil {
			_, file, line, _ := runtime.Caller(1)
			t.Fatalf("%s:%d: %v", file, line, err)
		}
	}
	up, err := netlink.LinkByName("up0")
	must(err)
	must(netlink.AddrAdd(up, &netlink.Addr{IPNet: prefixNet(uplinkHost)}))
	must(netlink.LinkSetUp(up))
	must(netlink.RouteAdd(&netlink.Route{Gw: uplinkPublic.Addr().AsSlice()}))
	// Metadata services: 169.254.169.254 on this namespace's loopback, as on
	// a host that serves it itself; the others outside, reached through the
	// uplink, as a cloud's are.
	lo, err := netlink.LinkByName("lo")
	must(err)
	must(netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(MetadataAddrs[0], 32))}))
	w.closers = append(w.closers, func() {
		_ = netlink.AddrDel(lo, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(MetadataAddrs[0], 32))})
	})
	w.serveHTTP(t, netns.None(), netip.AddrPortFrom(MetadataAddrs[0], 80), "metadata "+MetadataAddrs[0].String())
	w.HostHTTP = w.serveHTTP(t, netns.None(), netip.AddrPortFrom(uplinkHost.Addr(), 0), "host")
	w.HostLo = w.serveHTTP(t, netns.None(), netip.MustParseAddrPort("127.0.0.1:0"), "host loopback")
	// The outside: public hosts and resolvers.
	must(inNS(pub, func() error {
		wan, err := netlink.LinkByName("wan0")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(wan, &netlink.Addr{IPNet: prefixNet(uplinkPublic)}); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(wan); err != nil {
			return err
		}
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		for _, a := range append([]netip.Addr{PublicHost, OtherHost, UpstreamDNS, ForeignDNS}, MetadataAddrs[1:]...) {
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(a, 32))}); err != nil {
				return err
			}
		}
		return netlink.LinkSetUp(lo)
	}))
	w.serveHTTP(t, pub, netip.AddrPortFrom(PublicHost, 80), "public "+PublicHost.String())
	w.serveHTTP(t, pub, netip.AddrPortFrom(PublicHost, 8080), "public 8080")
	w.serveHTTP(t, pub, netip.AddrPortFrom(OtherHost, 80), "other "+OtherHost.String())
	for _, a := range MetadataAddrs[1:] {
		w.serveHTTP(t, pub, netip.AddrPortFrom(a, 80), "metadata "+a.String())
	}
	w.serveSink(t, pub, netip.AddrPortFrom(PublicHost, SinkPort))
	w.serveDNS(t, pub, UpstreamDNS, &w.upstream, true)
	w.serveDNS(t, pub, ForeignDNS, &w.foreign, false)
	return w
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}
}

// newNS makes an anonymous network namespace and returns a handle on it.
func newNS() (netns.NsHandle, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return 0, err
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		return 0, err
	}
	return ns, netns.Set(orig)
}

// inNS runs fn on a thread in ns: sockets it makes live there.
func inNS(ns netns.NsHandle, fn func() error) error {
	if ns == netns.None() {
		return fn()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		return err
	}
	defer netns.Set(orig)
	return fn()
}

// InNS runs fn in ns (for a test that acts from the outside).
func InNS(ns netns.NsHandle, fn func() error) error { return inNS(ns, fn) }

func (w *World) serveHTTP(t testing.TB, ns netns.NsHandle, at netip.AddrPort, name string) netip.AddrPort {
	t.Helper()
	var l net.Listener
	if err := inNS(ns, func() (err error) { l, err = net.Listen("tcp4", at.String()); return }); err != nil {
		t.Fatalf("listen %s: %v", at, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w.mu.Lock()
		w.hits[name]++
		w.mu.Unlock()
		fmt.Fprint(rw, name)
	})}
	go func() { _ = srv.Serve(l) }()
	w.closers = append(w.closers, func() { srv.Close() })
	return netip.MustParseAddrPort(l.Addr().String())
}

func (w *World) serveDNS(t testing.TB, ns netns.NsHandle, at netip.Addr, log *[]string, answer bool) {
	t.Helper()
	var pc net.PacketConn
	var l net.Listener
	if err := inNS(ns, func() (err error) {
		if pc, err = net.ListenPacket("udp4", at.String()+":53"); err != nil {
			return err
		}
		l, err = net.Listen("tcp4", at.String()+":53")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	h := dns.HandlerFunc(func(rw dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg).SetReply(q)
		if len(q.Question) == 1 {
			name := strings.TrimSuffix(strings.ToLower(q.Question[0].Name), ".")
			w.mu.Lock()
			*log = append(*log, name)
			w.mu.Unlock()
			a, ok := Zone[name]
			switch {
			case !answer || !ok:
				m.Rcode = dns.RcodeNameError
			case q.Question[0].Qtype == dns.TypeA:
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: a.AsSlice()})
			}
		}
		_ = rw.WriteMsg(m)
	})
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: l, Handler: h}} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
		w.closers = append(w.closers, func() { _ = s.Shutdown() })
	}
}

// SinkPort is where PublicHost takes TCP streams and discards them (for
// throughput measurements).
const SinkPort = 9000

func (w *World) serveSink(t testing.TB, ns netns.NsHandle, at netip.AddrPort) {
	t.Helper()
	var l net.Listener
	if err := inNS(ns, func() (err error) { l, err = net.Listen("tcp4", at.String()); return }); err != nil {
		t.Fatalf("listen %s: %v", at, err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				n, _ := io.Copy(io.Discard, c)
				fmt.Fprintf(c, "%d\n", n)
			}()
		}
	}()
	w.closers = append(w.closers, func() { l.Close() })
}

// UpstreamAsked lists the names the upstream resolver was asked.
func (w *World) UpstreamAsked() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.upstream...)
}

// ForeignAsked lists the names the foreign resolver was asked.
func (w *World) ForeignAsked() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.foreign...)
}

// Hits is how many requests the HTTP server called name answered.
func (w *World) Hits(name string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.hits[name]
}

// Upstreams is the resolver configuration for cage in this world.
func (w *World) Upstreams() []string { return []string{UpstreamDNS.String() + ":53"} }

func (w *World) close() {
	for i := len(w.closers) - 1; i >= 0; i-- {
		w.closers[i]()
	}
}
