package daemon

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// TestConnLimiter: a client address over its cap is closed at once, and
// others still get in; closing a connection frees its slot.
func TestConnLimiter(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := limitConns(raw, 3, 5)
	defer l.Close()
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func(from string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// closedByServer reports whether the server closed c (a read gets EOF).
	closedByServer := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		ne, ok := err.(net.Error)
		return !(ok && ne.Timeout())
	}
	var hostile, served []net.Conn
	for i := 0; i < 3; i++ {
		hostile = append(hostile, dial("127.0.0.2"))
		served = append(served, <-accepted)
	}
	extra := dial("127.0.0.2")
	if !closedByServer(extra) {
		t.Errorf("a 4th connection from one address (cap 3) stayed open")
	}
	other := dial("127.0.0.3")
	select {
	case <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("another address was not let in while the first is at its cap")
	}
	if closedByServer(other) {
		t.Errorf("another address's connection was closed")
	}
	if n := l.count(); n != 4 {
		t.Errorf("%d connections counted open, want 4", n)
	}
	// Closing on the server's side (as http.Server does) frees the slot.
	served[0].Close()
	served[0].Close() // twice: counted once
	if n := l.count(); n != 3 {
		t.Errorf("%d connections counted open after one closed, want 3", n)
	}
	again := dial("127.0.0.2")
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(5 * time.Second):
		t.Error("a freed slot was not given to the next connection")
	}
	for _, c := range append(hostile, other, again, extra) {
		c.Close()
	}
}

// TestConnLimiterPeer: in cluster mode another node's forwards are many
// clients' and arrive from its one address; the listener holds a peer's
// address to the bound on all connections only, others still to their
// own (see cluster/peers.go).
func TestConnLimiterPeer(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := limitConns(raw, 2, 5)
	defer l.Close()
	l.setPeer(func(a netip.Addr) bool { return a == netip.MustParseAddr("127.0.0.4") })
	served := make(chan net.Conn, 16) // held open by the server
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			served <- c
		}
	}()
	open := func(from string) (closed bool) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		_, err = c.Read(make([]byte, 1))
		ne, ok := err.(net.Error)
		return !(ok && ne.Timeout())
	}
	for i := 0; i < 4; i++ {
		if open("127.0.0.4") {
			t.Errorf("the peer's connection %d (per-client cap 2) was closed", i+1)
		}
	}
	if open("127.0.0.2") {
		t.Error("another address's first connection (the 5th of 5) was closed")
	}
	if !open("127.0.0.4") {
		t.Error("the peer's connection past the bound on all (5) stayed open")
	}
}

// TestConnLimiterIPv6Prefix: an IPv6 client is its /64, whose 2^64
// addresses are one holder's: connections from many of them share one
// cap, and another /64 is let in. Before: each address had a cap of its
// own, so one client filled the listener's total and every other
// client's connections were closed at once. Runs in a network namespace
// of its own, whose loopback answers for a /64 of documentation addresses.
func TestConnLimiterIPv6Prefix(t *testing.T) {
	testutil.RequireRoot(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// This thread alone moves to the new namespace and dies with the
		// goroutine (never unlocked); the sockets made here stay in it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			t.Errorf("unshare: %v", err)
			return
		}
		if out, err := exec.Command("sh", "-c", "ip link set lo up && for a in 2001:db8:1::1 2001:db8:1::2 2001:db8:1::3 2001:db8:1::ffff:1 2001:db8:2::1; do ip -6 addr add $a/128 dev lo nodad || exit; done").CombinedOutput(); err != nil {
			// exec forks from this thread: the child is in the namespace.
			t.Errorf("set up the namespace: %v: %s", err, out)
			return
		}
		raw, err := net.Listen("tcp", "[::1]:0")
		if err != nil {
			t.Error(err)
			return
		}
		l := limitConns(raw, 3, 100)
		defer l.Close()
		accepted := make(chan net.Conn, 16)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted <- c
			}
		}()
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		dial := func(from string) net.Conn {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
			c, err := d.Dial("tcp", raw.Addr().String())
			if err != nil {
				t.Errorf("dial from %s: %v", from, err)
				return nil
			}
			conns = append(conns, c)
			return c
		}
		for i := 1; i <= 3; i++ {
			if dial(fmt.Sprintf("2001:db8:1::%x", i)) == nil {
				return
			}
			<-accepted
		}
		// A fourth address of the same /64: over its cap, closed at once.
		extra := dial("2001:db8:1::ffff:1")
		if extra == nil {
			return
		}
		_ = extra.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := extra.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
			t.Errorf("a 4th connection from the same /64 (cap 3) stayed open: %v", err)
		}
		if dial("2001:db8:2::1") == nil {
			return
		}
		select {
		case <-accepted:
		case <-time.After(5 * time.Second):
			t.Error("another /64 was not let in while the first is at its cap")
		}
		if n := l.count(); n != 4 {
			t.Errorf("%d connections counted open, want 4", n)
		}
	}()
	<-done
}

// TestConnLimiterOwnConnections: the daemon's own connections to its proxy
// (the dashboard's terminals and files, /mcp's tools: every tenant's, all
// from the loopback address) are held to the bound on all connections,
// not to the loopback address's. Attack: local users, or a few keys'
// sessions held open, fill the loopback address's conns_per_client.
// Expected: the daemon's own connections still get in; another plain
// connection from the address does not.
func TestConnLimiterOwnConnections(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := limitConns(raw, 2, 10)
	defer l.Close()
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	open := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		ne, ok := err.(net.Error)
		return ok && ne.Timeout()
	}
	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		<-accepted
	}
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range 3 {
		c, err := l.dialOwn(t.Context(), "tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if !open(c) {
			t.Fatalf("the daemon's own connection %d was closed with the loopback address's bound (2) full", i)
		}
		<-accepted
	}
	plain, err := net.Dial("tcp", raw.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if open(plain) {
		t.Errorf("a plain connection from the full loopback address stayed open")
	}
	if n := l.count(); n != 5 {
		t.Errorf("%d connections counted, want 5 (all held to the bound on all)", n)
	}
	l.mu.Lock()
	local := l.client[netip.MustParseAddr("127.0.0.1")]
	l.mu.Unlock()
	if local != 2 {
		t.Errorf("the loopback address holds %d connections, want its own 2 (the daemon's are not its)", local)
	}
	// A dial that fails leaves no port remembered (its port may be
	// anyone's next).
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	dead.Close()
	if c, err := l.dialOwn(t.Context(), "tcp", deadAddr); err == nil {
		c.Close()
		t.Fatalf("dialled %s, which nothing listens on", deadAddr)
	}
	var left int
	l.own.Range(func(any, any) bool { left++; return true })
	if left != 0 {
		t.Errorf("%d own ports remembered after their accepts and a failed dial", left)
	}
}
