package network

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cagehq/cage/internal/testutil"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// A "sandbox" here is a bare network namespace with the veth attached, and
// the test acts from inside it: what the host enforces does not depend on
// the wall (the walls' own tests run the same cases from real sandboxes).
type fakeSandbox struct {
	ns  netns.NsHandle
	net *Sandbox
}

type recorder struct {
	mu sync.Mutex
	rs []Record
}

func (r *recorder) add(x Record) {
	r.mu.Lock()
	r.rs = append(r.rs, x)
	r.mu.Unlock()
}

func (r *recorder) find(f func(Record) bool) bool {
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		found := slices.ContainsFunc(r.rs, f)
		r.mu.Unlock()
		if found {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

func newHost(t *testing.T, w *testutil.World, rec *recorder) *Host {
	t.Helper()
	cfg := Config{Upstreams: w.Upstreams(), LockDir: t.TempDir()}
	if rec != nil {
		cfg.Record = rec.add
	}
	h, err := NewHost(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

var nextSlot = 100

func attach(t *testing.T, h *Host, p Policy) *fakeSandbox {
	t.Helper()
	ns := namespaces(t, 1)[0]
	nextSlot++
	sb, err := h.Attach(fmt.Sprintf("sb%d", nextSlot), nextSlot, int(ns), p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sb.Close() })
	return &fakeSandbox{ns: ns, net: sb}
}

// get fetches http://at/ from inside the sandbox.
func (s *fakeSandbox) get(at string) (string, error) {
	var body string
	err := testutil.InNS(s.ns, func() error {
		c, err := net.DialTimeout("tcp4", at, 2*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: x\r\n\r\n")
		b, err := io.ReadAll(c)
		if err != nil {
			return err
		}
		_, after, _ := strings.Cut(string(b), "\r\n\r\n")
		body = after
		return nil
	})
	return body, err
}

// lookup asks server (default: the gateway) for name's A record from inside.
func (s *fakeSandbox) lookup(server, name string, tcp bool) (*dns.Msg, error) {
	var ans *dns.Msg
	err := testutil.InNS(s.ns, func() error {
		c := &dns.Client{Timeout: 2 * time.Second}
		if tcp {
			c.Net = "tcp"
		}
		conn, err := c.Dial(server)
		if err != nil {
			return err
		}
		defer conn.Close()
		q := new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA)
		ans, _, err = c.ExchangeWithConn(q, conn)
		return err
	})
	return ans, err
}

func addrsOf(m *dns.Msg) []string {
	var out []string
	for _, rr := range m.Answer {
		if a, ok := rr.(*dns.A); ok {
			out = append(out, a.A.String())
		}
	}
	return out
}

func mustPolicy(t *testing.T, mode Mode, allow ...string) Policy {
	t.Helper()
	p := Policy{Mode: mode}
	for _, a := range allow {
		r, err := ParseRule(a)
		if err != nil {
			t.Fatal(err)
		}
		p.Allow = append(p.Allow, r)
	}
	return p
}

func refused(err error) bool {
	return err != nil
}

func TestInternetMode(t *testing.T) {
	w := testutil.NewWorld(t)
	rec := &recorder{}
	h := newHost(t, w, rec)
	a := attach(t, h, Policy{Mode: Internet})
	b := attach(t, h, Policy{Mode: Internet})
	gw := h.Gateway().String() + ":53"

	body, err := a.get(testutil.PublicHost.String() + ":80")
	if err != nil || body != "public "+testutil.PublicHost.String() {
		t.Fatalf("public host: %q, %v", body, err)
	}
	ans, err := a.lookup(gw, "other.example.org", false)
	if err != nil || !slices.Equal(addrsOf(ans), []string{testutil.OtherHost.String()}) {
		t.Fatalf("resolve other.example.org: %v %v", ans, err)
	}
	ans, err = a.lookup(gw, "www.example.com", true)
	if err != nil || len(addrsOf(ans)) != 1 {
		t.Fatalf("resolve over TCP: %v %v", ans, err)
	}
	// Always denied, in every spelling a program may write them: each is
	// one IPv4 address by the time it reaches a socket.
	for _, m := range testutil.MetadataAddrs {
		if body, err := a.get(m.String() + ":80"); !refused(err) {
			t.Errorf("metadata %s reachable: %q", m, body)
		}
	}
	if body, err := a.get(w.HostHTTP.String()); !refused(err) {
		t.Errorf("the host's own service %s reachable: %q", w.HostHTTP, body)
	}
	if body, err := a.get(fmt.Sprintf("%s:%d", h.Gateway(), w.HostLo.Port())); !refused(err) {
		t.Errorf("the host through the gateway reachable: %q", body)
	}
	// Another sandbox, by its address.
	var l net.Listener
	if err := testutil.InNS(b.ns, func() (err error) { l, err = net.Listen("tcp4", b.net.IP.String()+":8000"); return }); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprint(c, "HTTP/1.0 200 OK\r\n\r\nsandbox b")
			c.Close()
		}
	}()
	if body, err := a.get(b.net.IP.String() + ":8000"); !refused(err) {
		t.Errorf("another sandbox reachable: %q", body)
	}
	// Metadata by name: never resolved, never asked upstream.
	ans, err = a.lookup(gw, "metadata.google.internal", false)
	if err != nil || ans.Rcode != dns.RcodeNameError {
		t.Errorf("metadata.google.internal: %v %v", ans, err)
	}
	if slices.Contains(w.UpstreamAsked(), "metadata.google.internal") {
		t.Error("metadata.google.internal was asked upstream")
	}
	// Another resolver, plain or over TLS: refused; it sees nothing.
	if _, err := a.lookup(testutil.ForeignDNS.String()+":53", "www.example.com", false); err == nil {
		t.Error("a foreign resolver answered over UDP")
	}
	if _, err := a.lookup(testutil.ForeignDNS.String()+":53", "www.example.com", true); err == nil {
		t.Error("a foreign resolver answered over TCP")
	}
	if _, err := a.get(testutil.ForeignDNS.String() + ":853"); err == nil {
		t.Error("DNS over TLS port reachable")
	}
	if got := w.ForeignAsked(); len(got) != 0 {
		t.Errorf("the foreign resolver was asked %v", got)
	}
	if !rec.find(func(r Record) bool {
		return r.Kind == "connect" && r.Decision == "deny" && r.Dest == "169.254.169.254:80" && r.Sandbox == a.net.ID
	}) {
		t.Error("no record of the denied metadata connection")
	}
	if !rec.find(func(r Record) bool {
		return r.Kind == "connect" && r.Decision == "allow" && r.Dest == testutil.PublicHost.String()+":80"
	}) {
		t.Error("no record of the allowed connection")
	}
	if !rec.find(func(r Record) bool {
		return r.Kind == "dns" && r.Name == "metadata.google.internal" && r.Decision == "deny"
	}) {
		t.Error("no record of the denied name")
	}
}

func TestAllowlistMode(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, mustPolicy(t, Allowlist, "allowed.example.com", "*.example.com:8080", "rebind.example.org",
		"metadata.google.internal", testutil.OtherHost.String()+":80"))
	gw := h.Gateway().String() + ":53"

	// Before any lookup, the allowed name's address is closed.
	if _, err := s.get(testutil.PublicHost.String() + ":80"); err == nil {
		t.Fatal("an allowed name's address was open before it was resolved")
	}
	ans, err := s.lookup(gw, "allowed.example.com", false)
	if err != nil || !slices.Equal(addrsOf(ans), []string{testutil.PublicHost.String()}) {
		t.Fatalf("allowed.example.com: %v %v", ans, err)
	}
	if body, err := s.get(testutil.PublicHost.String() + ":80"); err != nil || !strings.HasPrefix(body, "public") {
		t.Fatalf("allowed host after lookup: %q %v", body, err)
	}
	// A CIDR with a port.
	if body, err := s.get(testutil.OtherHost.String() + ":80"); err != nil || !strings.HasPrefix(body, "other") {
		t.Fatalf("allowed address: %q %v", body, err)
	}
	// A wildcard with a port: api.example.com opens port 8080 only.
	if _, err := s.lookup(gw, "api.example.com", false); err != nil {
		t.Fatal(err)
	}
	// Not listed: NXDOMAIN, and nothing asked upstream.
	ans, err = s.lookup(gw, "other.example.org", false)
	if err != nil || ans.Rcode != dns.RcodeNameError {
		t.Fatalf("other.example.org: %v %v", ans, err)
	}
	// DNS tunnelling: data in long random labels of a name nobody allowed.
	var tunnel []string
	for range 20 {
		b := make([]byte, 24)
		_, _ = rand.Read(b)
		name := hex.EncodeToString(b) + ".exfil.example.org"
		tunnel = append(tunnel, name)
		ans, err := s.lookup(gw, name, false)
		if err != nil || ans.Rcode != dns.RcodeNameError {
			t.Fatalf("tunnel query %s: %v %v", name, ans, err)
		}
	}
	for _, asked := range w.UpstreamAsked() {
		if asked == "other.example.org" || slices.Contains(tunnel, asked) {
			t.Errorf("the upstream resolver was asked %q", asked)
		}
	}
	// A name allowed by the policy that points at metadata: resolved, but
	// the address stays denied. The metadata name itself is never resolved.
	if ans, err := s.lookup(gw, "rebind.example.org", false); err != nil || len(addrsOf(ans)) != 1 {
		t.Fatalf("rebind.example.org: %v %v", ans, err)
	}
	if body, err := s.get(testutil.MetadataAddrs[0].String() + ":80"); err == nil {
		t.Errorf("metadata reachable through an allowed name: %q", body)
	}
	if ans, err := s.lookup(gw, "metadata.google.internal", false); err != nil || ans.Rcode != dns.RcodeNameError {
		t.Errorf("metadata.google.internal allowed by policy: %v %v", ans, err)
	}

	// A policy change: internet, then nothing.
	if err := s.net.SetPolicy(Policy{Mode: Internet}); err != nil {
		t.Fatal(err)
	}
	if ans, err := s.lookup(gw, "other.example.org", false); err != nil || len(addrsOf(ans)) != 1 {
		t.Fatalf("after the change to internet: %v %v", ans, err)
	}
	if _, err := s.get(testutil.OtherHost.String() + ":80"); err != nil {
		t.Fatal(err)
	}
	if err := s.net.SetPolicy(Policy{Mode: None}); err != nil {
		t.Fatal(err)
	}
	if body, err := s.get(testutil.PublicHost.String() + ":80"); err == nil {
		t.Fatalf("after the change to none: %q", body)
	}
	if ans, err := s.lookup(gw, "allowed.example.com", false); err != nil || ans.Rcode != dns.RcodeNameError {
		t.Fatalf("resolve after the change to none: %v %v", ans, err)
	}
}

func TestCloseAndGC(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, Policy{Mode: Internet})
	if err := s.net.Close(); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(hostLinks(), s.net.Slot) {
		t.Error("veth left after Close")
	}
	if slots, _ := h.nft.slots(); slices.Contains(slots, s.net.Slot) {
		t.Error("rules left after Close")
	}
	// A sandbox whose owner vanished: GC removes what no live slot holds.
	s2 := attach(t, h, Policy{Mode: Internet})
	h.mu.Lock()
	delete(h.bySlot, s2.net.Slot) // as if another, dead process owned it
	h.mu.Unlock()
	removed := h.GC(func(int) bool { return false })
	if !slices.Contains(removed, s2.net.Slot) {
		t.Errorf("GC removed %v, not slot %d", removed, s2.net.Slot)
	}
	if slots, _ := h.nft.slots(); slices.Contains(slots, s2.net.Slot) {
		t.Error("rules left after GC")
	}
	if _, err := s2.get(testutil.PublicHost.String() + ":80"); err == nil {
		t.Error("a collected sandbox still reaches out")
	}
}

// A slot's interface left by a sandbox whose owner died (here: a pair of
// the same name) does not stop the next sandbox on that slot: attaching
// replaces it, and the new sandbox reaches out through its own pair.
func TestAttachReplacesLeftoverLink(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	nextSlot++
	slot := nextSlot
	stale := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: ifName(slot)}, PeerName: fmt.Sprintf("stale%d", slot)}
	if err := netlink.LinkAdd(stale); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = removeLink(slot) })
	ns := namespaces(t, 1)[0]
	sb, err := h.Attach(fmt.Sprintf("sb%d", slot), slot, int(ns), Policy{Mode: Internet})
	if err != nil {
		t.Fatalf("attach over a leftover link: %v", err)
	}
	s := &fakeSandbox{ns: ns, net: sb}
	l, err := netlink.LinkByName(ifName(slot))
	if err != nil {
		t.Fatal(err)
	}
	if l.Attrs().Index == stale.Index {
		t.Errorf("%s is still the leftover (index %d)", ifName(slot), stale.Index)
	}
	if _, err := netlink.LinkByName(fmt.Sprintf("stale%d", slot)); err == nil {
		t.Error("the leftover's peer is still there")
	}
	if _, err := s.get(testutil.PublicHost.String() + ":80"); err != nil {
		t.Errorf("the sandbox on a reclaimed slot cannot reach out: %v", err)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(hostLinks(), slot) {
		t.Error("veth left after Close")
	}
}

func TestParseRule(t *testing.T) {
	for in, want := range map[string]string{
		"Example.COM":       "example.com",
		"*.example.com:443": "*.example.com:443",
		"93.184.216.34":     "93.184.216.34",
		"10.1.2.3/16:5432":  "10.1.0.0/16:5432",
		"example.com.":      "example.com",
	} {
		r, err := ParseRule(in)
		if err != nil || r.String() != want {
			t.Errorf("ParseRule(%q) = %q, %v; want %q", in, r, err, want)
		}
	}
	for _, bad := range []string{"", "::1", "[::1]:80", "fd00::/8", "a..b", "ex ample.com", "a.*.com", "host:0", "host:99999", "1.2.3.4/33", "300.1.1.1", "*"} {
		if _, err := ParseRule(bad); !errors.Is(err, ErrPolicy) {
			t.Errorf("ParseRule(%q): %v, want ErrPolicy", bad, err)
		}
	}
}

func TestNamePorts(t *testing.T) {
	p := mustPolicy(t, Allowlist, "example.com:443", "*.example.com", "api.test:80", "api.test:8080")
	cases := []struct {
		name  string
		ok    bool
		ports []uint16
	}{
		{"example.com", true, []uint16{443}},
		{"www.example.com", true, []uint16{0}},
		{"deep.www.example.com.", true, []uint16{0}},
		{"badexample.com", false, nil},
		{"api.test", true, []uint16{80, 8080}},
		{"metadata.google.internal", false, nil},
	}
	for _, c := range cases {
		ok, ports := p.NamePorts(c.name)
		if ok != c.ok || !slices.Equal(ports, c.ports) {
			t.Errorf("NamePorts(%q) = %v %v, want %v %v", c.name, ok, ports, c.ok, c.ports)
		}
	}
	inet := Policy{Mode: Internet, Deny: []Rule{{Name: "*.ads.test"}}, Allow: []Rule{{Name: "ok.ads.test"}}}
	if ok, _ := inet.NamePorts("x.ads.test"); ok {
		t.Error("a denied name resolves in internet mode")
	}
	if ok, _ := inet.NamePorts("ok.ads.test"); !ok {
		t.Error("allow does not override deny in internet mode")
	}
	if ok, _ := inet.NamePorts("metadata.google.internal"); ok {
		t.Error("metadata resolves in internet mode")
	}
}

func TestDeniedSpans(t *testing.T) {
	spans := deniedSpans([]netip.Prefix{netip.MustParsePrefix("10.20.0.0/16")}, DefaultSubnet)
	for a, want := range map[string]bool{
		"169.254.169.254": true, "100.100.100.200": true, "168.63.129.16": true, "10.1.1.1": true,
		"10.20.3.4": false, "10.209.1.5": true, "127.0.0.1": true, "0.0.0.0": true, "255.255.255.255": true,
		"93.184.216.34": false, "8.8.8.8": false, "172.31.255.255": true, "172.32.0.1": false, "192.168.1.1": true,
	} {
		if got := denied(spans, netip.MustParseAddr(a)); got != want {
			t.Errorf("denied(%s) = %v, want %v", a, got, want)
		}
	}
	// The sandbox subnet cannot be opened.
	if !denied(deniedSpans([]netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, DefaultSubnet), netip.MustParseAddr("10.209.0.9")) {
		t.Error("opening 10/8 opened the sandbox subnet")
	}
}
