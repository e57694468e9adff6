package network

import (
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// gatedRecorder holds the first record it is given (and so the goroutine
// that gives it) until open is closed.
type gatedRecorder struct {
	recorder
	entered chan struct{}
	open    chan struct{}
	once    sync.Once
}

func (g *gatedRecorder) add(x Record) {
	g.once.Do(func() { close(g.entered) })
	<-g.open
	g.recorder.add(x)
}

// reuseSlot closes the sandbox in slot and attaches "new" to it in ns.
func reuseSlot(t *testing.T, h *Host, old *Sandbox, ns int, p Policy) *Sandbox {
	t.Helper()
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	sb, err := h.Attach("new", old.Slot, ns, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sb.Close() })
	if sb.IP != old.IP {
		t.Fatalf("the reused slot has address %s, the old one had %s", sb.IP, old.IP)
	}
	return sb
}

// Attack: a sandbox's connections are logged by the kernel and turned into
// records by the host later; the sandbox ends while some are still queued
// (the reader is busy with a record), and another tenant's sandbox takes
// its slot, and so its address. Expected: the queued connection is never
// recorded as the new sandbox's; the new sandbox's own are.
func TestQueuedLogRecordsKeepTheirSandbox(t *testing.T) {
	testutil.NewWorld(t)
	g := &gatedRecorder{entered: make(chan struct{}), open: make(chan struct{})}
	h, err := NewHost(Config{Upstreams: []string{"127.0.0.1:9"}, LockDir: t.TempDir(), Record: g.add})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	t.Cleanup(func() {
		select {
		case <-g.open:
		default:
			close(g.open)
		}
	})
	nextSlot++
	ns := namespaces(t, 2)
	old, err := h.Attach("old", nextSlot, int(ns[0]), Policy{Mode: Internet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = old.Close() })
	a := &fakeSandbox{ns: ns[0], net: old}
	if _, err := a.get(testutil.PublicHost.String() + ":80"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-g.entered: // the log reader is held in the first record
	case <-time.After(5 * time.Second):
		t.Fatal("no record of the first connection")
	}
	queued := testutil.PublicHost.String() + ":8080"
	if _, err := a.get(queued); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the kernel hands its record to the log socket within 10 ms
	sb := reuseSlot(t, h, old, int(ns[1]), Policy{Mode: Internet})
	close(g.open)
	b := &fakeSandbox{ns: ns[1], net: sb}
	_, _ = b.get(testutil.OtherHost.String() + ":80")
	if !g.find(func(r Record) bool {
		return r.Sandbox == "new" && r.Kind == "connect" && r.Dest == testutil.OtherHost.String()+":80"
	}) {
		t.Error("the new sandbox's own connection was not recorded")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, r := range g.rs {
		if r.Sandbox == "new" && r.Dest == queued {
			t.Errorf("the old sandbox's connection to %s was recorded as the new sandbox's: %+v", queued, r)
		}
	}
}

// Attack: a sandbox pipelines questions on one TCP connection to the
// resolver, which answers them one by one, each after its upstream answer
// (held here); the sandbox ends and another tenant's sandbox takes its
// slot, and so its address, before the questions left are served.
// Expected: none of them is served or recorded as the new sandbox's.
func TestQueuedQuestionsKeepTheirSandbox(t *testing.T) {
	testutil.NewWorld(t)
	up := newHeldUpstream(t)
	rec := &recorder{}
	h, err := NewHost(Config{Upstreams: []string{up.addr}, LockDir: t.TempDir(), Record: rec.add})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	nextSlot++
	ns := namespaces(t, 2)
	old, err := h.Attach("old", nextSlot, int(ns[0]), Policy{Mode: Internet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = old.Close() })
	gw := h.Gateway().String() + ":53"
	pipelined := []string{"allowed.example.com", "www.example.com", "api.example.com"}
	var c net.Conn
	if err := testutil.InNS(ns[0], func() (err error) { c, err = net.DialTimeout("tcp4", gw, 2*time.Second); return }); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var wire []byte
	for i, name := range pipelined {
		q := new(dns.Msg).SetQuestion(dns.Fqdn(name), dns.TypeA)
		q.Id = uint16(i + 1)
		b, err := q.Pack()
		if err != nil {
			t.Fatal(err)
		}
		wire = append(wire, byte(len(b)>>8), byte(len(b)))
		wire = append(wire, b...)
	}
	if _, err := c.Write(wire); err != nil {
		t.Fatal(err)
	}
	select {
	case name := <-up.asked:
		if name != pipelined[0] {
			t.Fatalf("upstream asked %q first", name)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the first question never reached the upstream")
	}
	sb := reuseSlot(t, h, old, int(ns[1]), Policy{Mode: Internet})
	close(up.release)
	b := &fakeSandbox{ns: ns[1], net: sb}
	if _, err := b.lookup(gw, "other.example.org", false); err != nil {
		t.Fatalf("the new sandbox's own question: %v", err)
	}
	if !rec.find(func(r Record) bool { return r.Sandbox == "new" && r.Name == "other.example.org" }) {
		t.Error("the new sandbox's own question was not recorded")
	}
	time.Sleep(time.Second) // the questions left are served, if ever, by now
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, r := range rec.rs {
		if r.Sandbox == "new" && slices.Contains(pipelined, r.Name) {
			t.Errorf("the old sandbox's question was recorded as the new sandbox's: %+v", r)
		}
	}
	for len(up.asked) > 0 {
		if name := <-up.asked; slices.Contains(pipelined, name) {
			t.Errorf("the old sandbox's question for %s was asked upstream after it ended", name)
		}
	}
}
