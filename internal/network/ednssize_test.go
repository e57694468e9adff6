package network

import (
	"fmt"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// slowUpstream is an upstream resolver, on loopback, that holds every
// question until release is called (the test's end calls it too), then
// answers PublicHost. It counts the questions it got, and the largest
// EDNS buffer size they claimed.
type slowUpstream struct {
	addr    string
	mu      sync.Mutex
	asked   int
	most    uint16
	release func()
}

func newSlowUpstream(t *testing.T) *slowUpstream {
	t.Helper()
	u := &slowUpstream{}
	held := make(chan struct{})
	var once sync.Once
	u.release = func() { once.Do(func() { close(held) }) }
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		u.mu.Lock()
		u.asked++
		if opt := q.IsEdns0(); opt != nil {
			u.most = max(u.most, opt.UDPSize())
		}
		u.mu.Unlock()
		<-held
		m := new(dns.Msg).SetReply(q)
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: testutil.PublicHost.AsSlice()})
		_ = w.WriteMsg(m)
	})
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = pc.LocalAddr().String()
	srv := &dns.Server{PacketConn: pc, Handler: handler}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { u.release(); _ = srv.Shutdown() })
	return u
}

func (u *slowUpstream) stats() (asked int, most uint16) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.asked, u.most
}

// askMany sends questions for n distinct names under example.com from
// inside the sandbox over UDP, each claiming an EDNS buffer of 65,535
// bytes, and returns the socket (closed at the test's end).
func askMany(t *testing.T, h *Host, s *fakeSandbox, n int) net.PacketConn {
	t.Helper()
	var c net.PacketConn
	if err := testutil.InNS(s.ns, func() (err error) { c, err = net.ListenPacket("udp4", ":0"); return }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	gw := &net.UDPAddr{IP: h.Gateway().AsSlice(), Port: 53}
	for i := range n {
		q := new(dns.Msg).SetQuestion(fmt.Sprintf("n%d.example.com.", i), dns.TypeA)
		q.SetEdns0(65535, false)
		b, _ := q.Pack()
		if _, err := c.WriteTo(b, gw); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// answers reads the answers on c until none comes for a while: how many
// had an address, and how many were SERVFAIL.
func answers(c net.PacketConn, wait time.Duration) (ok, servfail int) {
	buf := make([]byte, 65535)
	for {
		_ = c.SetReadDeadline(time.Now().Add(wait))
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return ok, servfail
		}
		var m dns.Msg
		if m.Unpack(buf[:n]) != nil {
			continue
		}
		switch {
		case len(m.Answer) == 1:
			ok++
		case m.Rcode == dns.RcodeServerFailure:
			servfail++
		}
	}
}

func slowHost(t *testing.T) (*Host, *slowUpstream) {
	t.Helper()
	testutil.NewWorld(t)
	u := newSlowUpstream(t)
	h, err := NewHost(Config{Upstreams: []string{u.addr}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	t.Cleanup(u.release) // before the host closes: its questions end
	return h, u
}

// Attack: a sandbox asks for names its policy allows with an EDNS buffer
// size of 65,535, the most a question may claim, while the upstream is
// slow to answer (a name under the tenant's own slow servers, seconds
// each). The question asked upstream carried the sandbox's size, and the
// resolver's client reserves a receive buffer of that size for each
// question on its way: 64 KiB of the daemon's heap per question, charged
// to no sandbox, 100 questions a second for up to 4 s each per upstream.
// Expected: the question upstream claims at most upstreamUDPSize (a
// larger answer comes over TCP, as any truncated one does), and the
// sandbox still gets its answers.
func TestUpstreamBufferBounded(t *testing.T) {
	h, u := slowHost(t)
	s := attach(t, h, Policy{Mode: Internet})
	const questions = maxAsking
	runtime.GC()
	var before, during runtime.MemStats
	runtime.ReadMemStats(&before)
	c := askMany(t, h, s, questions)
	time.Sleep(500 * time.Millisecond) // every question is on its way upstream
	runtime.ReadMemStats(&during)
	t.Logf("%d questions on their way upstream: the heap in use grew %d KiB", questions, (int64(during.HeapInuse)-int64(before.HeapInuse))>>10)
	u.release()
	ok, _ := answers(c, 2*time.Second)
	if _, most := u.stats(); most > upstreamUDPSize {
		t.Errorf("a question upstream claimed a buffer of %d bytes; want at most %d", most, upstreamUDPSize)
	}
	if ok != questions {
		t.Errorf("%d of %d questions answered; want all", ok, questions)
	}
}

// Attack: a sandbox asks for many names its policy allows at once, while
// the upstream is slow to answer (the tenant's own slow name servers).
// Each question on its way upstream is a goroutine, a socket and a buffer
// of the daemon's, charged to no sandbox, for up to 4 s per upstream.
// Expected: at most maxAsking of the sandbox's questions are on their way
// at once; the others get SERVFAIL at once; those asked are answered once
// the upstream answers.
func TestQuestionsOnTheirWayBounded(t *testing.T) {
	h, u := slowHost(t)
	s := attach(t, h, Policy{Mode: Internet})
	const questions = 200
	c := askMany(t, h, s, questions)
	_, failed := answers(c, 500*time.Millisecond)
	asked, _ := u.stats()
	t.Logf("of %d questions, %d were asked upstream at once and %d got SERVFAIL", questions, asked, failed)
	if asked > maxAsking {
		t.Errorf("%d of the sandbox's questions were on their way upstream at once; want at most %d", asked, maxAsking)
	}
	u.release()
	ok, _ := answers(c, 2*time.Second)
	if ok != asked || ok+failed != questions {
		t.Errorf("%d answered and %d SERVFAIL of %d questions, %d asked upstream; want every one asked answered, every other SERVFAIL", ok, failed, questions, asked)
	}
}
