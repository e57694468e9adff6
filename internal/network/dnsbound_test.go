package network

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// hugeAnswers serves, on loopback, an attacker's own name servers: any A
// question under attacker.test gets perAnswer fresh addresses (TTL an
// hour), truncated over UDP and whole over TCP; other names get
// PublicHost.
func hugeAnswers(t *testing.T, perAnswer int) string {
	t.Helper()
	var next atomic.Uint32
	next.Store(u32(netip.MustParseAddr("11.0.0.0")))
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg).SetReply(q)
		name := q.Question[0].Name
		if _, udp := w.RemoteAddr().(*net.UDPAddr); udp && strings.HasSuffix(name, "attacker.test.") {
			m.Truncated = true
			_ = w.WriteMsg(m)
			return
		}
		if q.Question[0].Qtype == dns.TypeA {
			hdr := dns.RR_Header{Name: name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 3600}
			if strings.HasSuffix(name, "attacker.test.") {
				base := next.Add(uint32(perAnswer)) - uint32(perAnswer)
				for i := range perAnswer {
					m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: binary.BigEndian.AppendUint32(nil, base+uint32(i))})
				}
			} else {
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: testutil.PublicHost.AsSlice()})
			}
		}
		m.Compress = true
		_ = w.WriteMsg(m)
	})
	return serveDNS(t, h)
}

// Attack: a tenant allows (or, in internet mode, denies) a wildcard of its
// own domain, whose servers answer every name with 500 addresses; code in
// the sandbox asks for 200 names. Each address was an element of the
// shared sets (100,000 for one sandbox, with no end but the TTL), which
// every tenant's rule updates and GC wait on. Expected: an answer gives
// the sandbox at most maxAnswerAddrs addresses, the sandbox's elements
// stay within maxSandboxElems (answers beyond get SERVFAIL, allowed
// names), and another sandbox's answers still come.
func TestDNSAnswersBounded(t *testing.T) {
	testutil.NewWorld(t)
	h, err := NewHost(Config{Upstreams: []string{hugeAnswers(t, 500)}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	gw := h.Gateway().String() + ":53"
	for _, c := range []struct {
		policy Policy
		set    string
		per    int // elements an address takes
	}{
		{mustPolicy(t, Allowlist, "*.attacker.test", "ok.example"), "n", 1},
		{mustPolicy(t, Allowlist, "*.attacker.test:80", "*.attacker.test:443", "ok.example"), "p", 2},
		{Policy{Mode: Internet, Deny: []Rule{{Name: "*.attacker.test"}}}, "y", 1},
	} {
		t.Run(c.set, func(t *testing.T) {
			s := attach(t, h, c.policy)
			most, refused := 0, 0
			err := testutil.InNS(s.ns, func() error {
				cl := &dns.Client{Net: "tcp", Timeout: 5 * time.Second}
				for i := range 200 {
					m, _, err := cl.Exchange(new(dns.Msg).SetQuestion(fmt.Sprintf("x%d.attacker.test.", i), dns.TypeA), gw)
					if err != nil {
						return err
					}
					most = max(most, len(m.Answer))
					if m.Rcode == dns.RcodeServerFailure {
						refused++
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if most > maxAnswerAddrs {
				t.Errorf("an answer gave the sandbox %d addresses; want at most %d", most, maxAnswerAddrs)
			}
			els, err := h.nft.elements(s.net.Slot, c.set)
			if err != nil {
				t.Fatal(err)
			}
			if len(els) > maxSandboxElems || len(els) < maxSandboxElems/2 {
				t.Errorf("set %s holds %d elements of the sandbox; want between %d and %d", c.set, len(els), maxSandboxElems/2, maxSandboxElems)
			}
			if c.policy.Mode == Allowlist {
				want := 200 - maxSandboxElems/(maxAnswerAddrs*c.per)
				if refused != want {
					t.Errorf("%d answers refused; want %d (those past the limit)", refused, want)
				}
			}
			// What one sandbox fills is its own: another's answers still come.
			o := attach(t, h, c.policy)
			if ans, err := o.lookup(gw, "ok.example", false); err != nil || ans.Rcode != dns.RcodeSuccess || len(ans.Answer) == 0 {
				t.Errorf("another sandbox's question, once the first is at its limit: %v %v", ans, err)
			}
			t.Logf("set %s: %d elements of the sandbox after 200 answers of 500 addresses; %d refused", c.set, len(els), refused)
		})
	}
}

// serveDNS serves h over UDP and TCP on one loopback address, until the
// test ends, and returns the address.
func serveDNS(t *testing.T, h dns.Handler) string {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp4", pc.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: l, Handler: h}} {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
		t.Cleanup(func() { _ = s.Shutdown() })
	}
	return pc.LocalAddr().String()
}
