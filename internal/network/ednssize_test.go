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

// Attack: a sandbox asks for names its policy allows with an EDNS buffer
// size of 65,535, the most a question may claim, while the upstream is
// slow to answer (a name under the tenant's own slow servers, seconds
// each). The question asked upstream carried the sandbox's size, and the
// resolver's client reserves a receive buffer of that size for each
// question on its way: 64 KiB of the daemon's heap per question, charged
// to no sandbox, 100 questions a second for up to 4 s each per upstream.
// Expected: the question upstream claims at most upstreamUDPSize (a
// larger answer comes over TCP, as any truncated one does), and the
// sandbox still gets its answer.
func TestUpstreamBufferBounded(t *testing.T) {
	testutil.NewWorld(t)
	var mu sync.Mutex
	most := uint16(0)
	release := make(chan struct{})
	var releaseOnce sync.Once
	hold := func() { releaseOnce.Do(func() { close(release) }) }
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		if opt := q.IsEdns0(); opt != nil {
			mu.Lock()
			most = max(most, opt.UDPSize())
			mu.Unlock()
		}
		<-release
		m := new(dns.Msg).SetReply(q)
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: testutil.PublicHost.AsSlice()})
		_ = w.WriteMsg(m)
	})
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: handler}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { hold(); _ = srv.Shutdown() })
	h, err := NewHost(Config{Upstreams: []string{pc.LocalAddr().String()}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	t.Cleanup(hold) // before the host closes: its questions end
	s := attach(t, h, Policy{Mode: Internet})
	gw := &net.UDPAddr{IP: h.Gateway().AsSlice(), Port: 53}

	const questions = 200
	runtime.GC()
	var before, during runtime.MemStats
	runtime.ReadMemStats(&before)
	var c net.PacketConn
	if err := testutil.InNS(s.ns, func() (err error) { c, err = net.ListenPacket("udp4", ":0"); return }); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range questions {
		q := new(dns.Msg).SetQuestion(fmt.Sprintf("n%d.example.com.", i), dns.TypeA)
		q.SetEdns0(65535, false)
		b, _ := q.Pack()
		if _, err := c.WriteTo(b, gw); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond) // every question is on its way upstream
	runtime.ReadMemStats(&during)
	t.Logf("%d questions on their way upstream: the heap in use grew %d KiB", questions, (int64(during.HeapInuse)-int64(before.HeapInuse))>>10)
	hold()
	answered := 0
	buf := make([]byte, 65535)
	for answered < questions {
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			break
		}
		var m dns.Msg
		if m.Unpack(buf[:n]) == nil && len(m.Answer) == 1 {
			answered++
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if most > upstreamUDPSize {
		t.Errorf("a question upstream claimed a buffer of %d bytes; want at most %d", most, upstreamUDPSize)
	}
	if answered == 0 {
		t.Error("no question was answered")
	}
}
