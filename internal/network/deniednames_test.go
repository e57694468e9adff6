package network

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// sameAnswers serves, on loopback, an attacker's own name servers that
// answer every A question under attacker.test with the same n addresses
// (TTL an hour), truncated over UDP and whole over TCP.
func sameAnswers(t *testing.T, n int) string {
	t.Helper()
	base := u32(netip.MustParseAddr("11.0.0.1"))
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg).SetReply(q)
		name := q.Question[0].Name
		if _, udp := w.RemoteAddr().(*net.UDPAddr); udp {
			m.Truncated = true
		} else if q.Question[0].Qtype == dns.TypeA && strings.HasSuffix(name, "attacker.test.") {
			hdr := dns.RR_Header{Name: name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 3600}
			for i := range n {
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: binary.BigEndian.AppendUint32(nil, base+uint32(i))})
			}
		}
		_ = w.WriteMsg(m)
	})
	return serveDNS(t, h)
}

// Attack: a tenant denies a wildcard of its own domain in internet mode,
// whose servers answer every name with the same 32 addresses; code in the
// sandbox asks for one new name after another. Each name's addresses are
// denied for their TTL (an hour here), and the host remembered each name
// with its addresses, but counted only the addresses new to the set
// against the sandbox's bound: after the first answer none was new, so
// the names held grew without bound, in the daemon's heap (100 a second,
// 360,000 within the TTL). Expected: the sandbox's denied names hold at
// most maxSandboxElems name-address pairs (their names still get
// NXDOMAIN).
func TestDeniedNamesBounded(t *testing.T) {
	testutil.NewWorld(t)
	h, err := NewHost(Config{Upstreams: []string{sameAnswers(t, maxAnswerAddrs)}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	gw := h.Gateway().String() + ":53"
	s := attach(t, h, Policy{Mode: Internet, Deny: []Rule{{Name: "*.attacker.test"}}})
	const names = 280 // within the resolver's burst of questions
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err = testutil.InNS(s.ns, func() error {
		cl := &dns.Client{Net: "tcp", Timeout: 5 * time.Second}
		for i := range names {
			q := new(dns.Msg).SetQuestion(fmt.Sprintf("x%d.attacker.test.", i), dns.TypeA)
			m, _, err := cl.Exchange(q, gw)
			if err != nil {
				return err
			}
			if m.Rcode != dns.RcodeNameError {
				return fmt.Errorf("x%d.attacker.test: %v; want NXDOMAIN", i, dns.RcodeToString[m.Rcode])
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	s.net.mu.Lock()
	held, pairs := len(s.net.denied), 0
	for _, m := range s.net.denied {
		pairs += len(m)
	}
	s.net.mu.Unlock()
	t.Logf("the sandbox holds %d denied names, %d name-address pairs; the heap in use grew %d KiB", held, pairs, (int64(after.HeapInuse)-int64(before.HeapInuse))>>10)
	if pairs > maxSandboxElems {
		t.Errorf("the sandbox's denied names hold %d name-address pairs; want at most %d", pairs, maxSandboxElems)
	}
	if els, err := h.nft.elements(s.net.Slot, "y"); err != nil || len(els) != maxAnswerAddrs {
		t.Errorf("the denied set holds %d addresses of the sandbox (%v); want the %d answered", len(els), err, maxAnswerAddrs)
	}
}
