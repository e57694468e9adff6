package network

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// heldUpstream is an upstream resolver that answers from testutil's zone
// only when the test lets it: it reports each question it holds on asked.
type heldUpstream struct {
	addr    string
	asked   chan string
	release chan struct{}
}

func newHeldUpstream(t *testing.T) *heldUpstream {
	t.Helper()
	u := &heldUpstream{asked: make(chan string, 16), release: make(chan struct{})}
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = pc.LocalAddr().String()
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		name := strings.TrimSuffix(q.Question[0].Name, ".")
		u.asked <- name
		<-u.release
		m := new(dns.Msg).SetReply(q)
		if a, ok := testutil.Zone[name]; ok {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: a.AsSlice()})
		}
		_ = w.WriteMsg(m)
	})}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() {
		select {
		case <-u.release:
		default:
			close(u.release)
		}
		_ = srv.Shutdown()
	})
	return u
}

// setHas reports whether one of the sandbox's sets ("n", "p", "y") holds a.
func setHas(t *testing.T, h *Host, s *fakeSandbox, which string, a netip.Addr) bool {
	t.Helper()
	els, err := h.nft.elements(s.net.Slot, which)
	if err != nil {
		t.Fatalf("set %s%d: %v", which, s.net.Slot, err)
	}
	return slices.Contains(els, a)
}

// Attack: the sandbox asks for a name its policy allows; while the answer
// is on its way, the policy is tightened to exclude the name. Expected: the
// late answer opens nothing (the sandbox gets SERVFAIL), the address stays
// closed.
func TestAnswerInFlightAfterPolicyChange(t *testing.T) {
	testutil.NewWorld(t) // the outside the addresses are in
	up := newHeldUpstream(t)
	h, err := NewHost(Config{Upstreams: []string{up.addr}, LockDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	s := attach(t, h, mustPolicy(t, Allowlist, "allowed.example.com"))
	gw := h.Gateway().String() + ":53"
	type result struct {
		ans *dns.Msg
		err error
	}
	done := make(chan result, 1)
	go func() {
		ans, err := s.lookup(gw, "allowed.example.com", false)
		done <- result{ans, err}
	}()
	select {
	case name := <-up.asked:
		if name != "allowed.example.com" {
			t.Fatalf("upstream asked %q", name)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the question never reached the upstream")
	}
	if err := s.net.SetPolicy(mustPolicy(t, Allowlist, "other.example.org")); err != nil {
		t.Fatal(err)
	}
	close(up.release)
	r := <-done
	if r.err == nil && len(addrsOf(r.ans)) > 0 {
		t.Errorf("the sandbox got an answer learnt under the old policy: %v", addrsOf(r.ans))
	}
	if setHas(t, h, s, "n", testutil.PublicHost) {
		t.Errorf("%s is in the learned set after the policy that allowed it was replaced", testutil.PublicHost)
	}
	if body, err := s.get(testutil.PublicHost.String() + ":80"); err == nil {
		t.Errorf("the tightened policy lets %s through: %q", testutil.PublicHost, body)
	}
}

// Attack: a sandbox floods its resolver with questions for a name its
// policy allows while the policy is replaced by one that does not allow it.
// Expected: once the flood is over, the name's address is in no set and is
// refused.
func TestPolicyChangeDuringDNSFlood(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, mustPolicy(t, Allowlist, "allowed.example.com"))
	gw := h.Gateway().String() + ":53"
	var stop atomic.Bool
	var answered atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for !stop.Load() {
				if ans, err := s.lookup(gw, "allowed.example.com", false); err == nil && len(addrsOf(ans)) > 0 {
					answered.Add(1)
				}
			}
		})
	}
	// The change comes once the flood is being answered (a veth's first
	// packet may wait a second for its neighbour), and the flood goes on
	// after it.
	for deadline := time.Now().Add(10 * time.Second); answered.Load() < 50 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if answered.Load() < 50 {
		stop.Store(true)
		wg.Wait()
		t.Fatalf("the flood got %d answers before the change: it would test nothing", answered.Load())
	}
	if err := s.net.SetPolicy(mustPolicy(t, Allowlist, "other.example.org")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	for _, set := range []string{"n", "p"} {
		if setHas(t, h, s, set, testutil.PublicHost) {
			t.Errorf("%s is in set %s after the change", testutil.PublicHost, set)
		}
	}
	if body, err := s.get(testutil.PublicHost.String() + ":80"); err == nil {
		t.Errorf("after the change during a flood, %s answers: %q", testutil.PublicHost, body)
	}
}

// conn is a TCP connection the sandbox opened.
type conn struct {
	t *testing.T
	c *net.TCPConn
}

func (s *fakeSandbox) dial(t *testing.T, at string) *conn {
	t.Helper()
	var c net.Conn
	if err := testutil.InNS(s.ns, func() (err error) { c, err = net.DialTimeout("tcp4", at, 2*time.Second); return }); err != nil {
		t.Fatalf("dial %s from the sandbox: %v", at, err)
	}
	t.Cleanup(func() { c.Close() })
	return &conn{t: t, c: c.(*net.TCPConn)}
}

// sinkTotal writes data, ends its side and returns the sink's count of
// what it received, or an error.
func (c *conn) sinkTotal(data string) (int, error) {
	_ = c.c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c.c, data); err != nil {
		return 0, err
	}
	if err := c.c.CloseWrite(); err != nil {
		return 0, err
	}
	line, err := bufio.NewReader(c.c).ReadString('\n')
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(line))
}

// httpGet sends one keep-alive request on the connection and returns the
// status line.
func (c *conn) httpGet(r *bufio.Reader) (string, error) {
	_ = c.c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c.c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		return "", err
	}
	status, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	n := 0
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return "", err
		}
		if v, ok := strings.CutPrefix(strings.ToLower(line), "content-length:"); ok {
			n, _ = strconv.Atoi(strings.TrimSpace(v))
		}
		if line == "\r\n" {
			break
		}
	}
	if _, err := io.CopyN(io.Discard, r, int64(n)); err != nil {
		return "", err
	}
	return strings.TrimSpace(status), nil
}

// Attack: a sandbox opens connections while its policy allows them and
// keeps using them after the policy is tightened. Expected: the connection
// the new policy refuses is cut (its next request fails); one the new
// policy still allows, by address or by a name that stays allowed, goes on.
func TestPolicyChangeCutsConnections(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	pub := testutil.PublicHost.String()
	s := attach(t, h, Policy{Mode: Internet})
	kept := s.dial(t, pub+":9000")
	cut := s.dial(t, pub+":8080")
	rd := bufio.NewReader(cut.c)
	if st, err := cut.httpGet(rd); err != nil || !strings.Contains(st, "200") {
		t.Fatalf("the first request: %q %v", st, err)
	}
	if _, err := io.WriteString(kept.c, "before "); err != nil {
		t.Fatal(err)
	}
	if err := s.net.SetPolicy(mustPolicy(t, Allowlist, pub+":9000")); err != nil {
		t.Fatal(err)
	}
	if st, err := cut.httpGet(rd); err == nil {
		t.Errorf("a connection the new policy refuses still answers: %q", st)
	}
	if n, err := kept.sinkTotal("after"); err != nil || n != len("before after") {
		t.Errorf("a connection the new policy allows: %d bytes, %v; want %d", n, err, len("before after"))
	}

	// By name: an address learned for a name the new policy still allows
	// keeps its connection; once the name goes, so does the connection.
	s2 := attach(t, h, mustPolicy(t, Allowlist, "allowed.example.com"))
	gw := h.Gateway().String() + ":53"
	if ans, err := s2.lookup(gw, "allowed.example.com", false); err != nil || len(addrsOf(ans)) != 1 {
		t.Fatalf("allowed.example.com: %v %v", ans, err)
	}
	byName := s2.dial(t, pub+":9000")
	if _, err := io.WriteString(byName.c, "one "); err != nil {
		t.Fatal(err)
	}
	if err := s2.net.SetPolicy(mustPolicy(t, Allowlist, "allowed.example.com", "other.example.org")); err != nil {
		t.Fatal(err)
	}
	if !setHas(t, h, s2, "n", testutil.PublicHost) {
		t.Error("a name the new policy still allows lost its learned address")
	}
	if n, err := byName.sinkTotal("two"); err != nil || n != len("one two") {
		t.Errorf("the connection of a name that stays allowed: %d, %v", n, err)
	}
	byName2 := s2.dial(t, pub+":9000")
	if _, err := io.WriteString(byName2.c, "one "); err != nil {
		t.Fatal(err)
	}
	if err := s2.net.SetPolicy(mustPolicy(t, Allowlist, "other.example.org")); err != nil {
		t.Fatal(err)
	}
	if n, err := byName2.sinkTotal("two"); err == nil {
		t.Errorf("the connection of a name the new policy drops still works (%d bytes)", n)
	}
}
