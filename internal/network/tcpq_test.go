package network

import (
	"errors"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/cagehq/cage/internal/testutil"
)

// Attack: a sandbox opens TCP connections to the resolver, each of which
// announces a question of 65,535 bytes (its 2-byte length prefix) and
// sends one byte of it. The resolver held a buffer of the announced size
// for each until the rest came or its read timed out (5 s; 10 s after a
// first question), in the daemon's heap, charged to no sandbox: within
// the sandbox's DNS packet rate, some 100 connections a second.
// Expected: such a connection is closed at once, holding nothing; a
// question of ordinary size over TCP is still answered.
func TestResolverTCPQuestionBounded(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, Policy{Mode: Internet})
	gw := h.Gateway().String() + ":53"
	if ans, err := s.lookup(gw, "www.example.com", true); err != nil || len(addrsOf(ans)) != 1 {
		t.Fatalf("a question over TCP: %v %v", ans, err)
	}
	// One such connection: the resolver closes it without waiting.
	err := testutil.InNS(s.ns, func() error {
		c, err := net.DialTimeout("tcp4", gw, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte{0xff, 0xff, 0}); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		_, err = c.Read(make([]byte, 16))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errors.New("the resolver kept the connection of a 65,535-byte question open, waiting for the rest")
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
	// Many, for the record: what the daemon's heap holds for them.
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	_ = testutil.InNS(s.ns, func() error {
		d := net.Dialer{Timeout: 200 * time.Millisecond}
		for start := time.Now(); time.Since(start) < 2*time.Second; {
			if c, err := d.Dial("tcp4", gw); err == nil {
				_, _ = c.Write([]byte{0xff, 0xff, 0})
				conns = append(conns, c)
			}
		}
		return nil
	})
	time.Sleep(100 * time.Millisecond)
	runtime.ReadMemStats(&after)
	t.Logf("%d connections announcing 65,535-byte questions; the heap in use grew %d KiB", len(conns), (int64(after.HeapInuse)-int64(before.HeapInuse))>>10)
}

// Attack: a sandbox keeps many TCP connections to the resolver open, each
// with a question every few seconds (its idle timeout is 10 s): each is a
// descriptor, a goroutine and socket buffers of the daemon's, charged to
// no sandbox. Expected: at most maxTCPConns of one sandbox are served at
// once (those past it are closed as they come); once they close, new ones
// are served again.
func TestResolverTCPConnsBounded(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	s := attach(t, h, Policy{Mode: Internet})
	gw := h.Gateway().String() + ":53"
	ask := func(c net.Conn) bool {
		dc := &dns.Conn{Conn: c}
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if err := dc.WriteMsg(new(dns.Msg).SetQuestion("www.example.com.", dns.TypeA)); err != nil {
			return false
		}
		m, err := dc.ReadMsg()
		return err == nil && m.Rcode == dns.RcodeSuccess
	}
	const n = 2 * maxTCPConns
	served := 0
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	err := testutil.InNS(s.ns, func() error {
		for range n {
			c, err := net.DialTimeout("tcp4", gw, time.Second)
			if err != nil {
				return err
			}
			conns = append(conns, c)
			if ask(c) {
				served++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d of %d connections kept open at once were served", served, n)
	if served > maxTCPConns || served == 0 {
		t.Errorf("%d of %d connections of one sandbox served at once; want 1 to %d", served, n, maxTCPConns)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	time.Sleep(200 * time.Millisecond) // the resolver sees them close
	if ans, err := s.lookup(gw, "www.example.com", true); err != nil || len(addrsOf(ans)) != 1 {
		t.Errorf("a question over a new connection once the others closed: %v %v", ans, err)
	}
}
