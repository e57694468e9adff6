package daemon

import (
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/proxy"
)

// Bounds of the daemon's two listeners, against clients that hold
// connections open (slowloris, idle keep-alives) or open them by the
// thousand: headers must arrive within HeaderTimeout, an idle keep-alive
// connection closes after IdleTimeout, and a client address holds at most
// ConnsPerClient connections of a listener, all clients together Conns.
// A connection over a bound is accepted and closed at once, so the kernel's
// queue keeps moving for everyone else.
const (
	HeaderTimeout  = 10 * time.Second
	IdleTimeout    = 2 * time.Minute
	maxHeaderBytes = 64 << 10
	// apiReadTimeout bounds reading a whole API request: its body is at
	// most 1 MiB.
	apiReadTimeout = time.Minute
)

// connLimiter is a listener that caps connections per client address and
// in all.
type connLimiter struct {
	net.Listener
	perClient, total int
	// peer, once set, names the addresses held to the bound on all
	// connections only: the cluster's other nodes, whose forwards are
	// many clients' (cluster.Front.Peer).
	peer atomic.Pointer[func(netip.Addr) bool]

	mu     sync.Mutex
	open   int
	client map[netip.Addr]int
}

func limitConns(l net.Listener, perClient, total int) *connLimiter {
	return &connLimiter{Listener: l, perClient: perClient, total: total, client: map[netip.Addr]int{}}
}

func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		from := remoteAddr(c)
		addr := clientOf(from)
		peer := false
		if p := l.peer.Load(); p != nil {
			peer = (*p)(from) // a node by its own address, not its /64
		}
		l.mu.Lock()
		ok := l.open < l.total && (l.client[addr] < l.perClient || peer)
		if ok {
			l.open++
			l.client[addr]++
		}
		l.mu.Unlock()
		if !ok {
			c.Close()
			continue
		}
		return &limitedConn{Conn: c, release: func() { l.release(addr) }}, nil
	}
}

// setPeer has the listener hold the addresses peer names to the bound
// on all connections only.
func (l *connLimiter) setPeer(peer func(netip.Addr) bool) { l.peer.Store(&peer) }

func (l *connLimiter) release(addr netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if l.client[addr]--; l.client[addr] <= 0 {
		delete(l.client, addr)
	}
}

// count is the number of open connections (tests).
func (l *connLimiter) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open
}

// remoteAddr is the address a connection comes from (the zero Addr for a
// unix socket).
func remoteAddr(c net.Conn) netip.Addr {
	ap, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{} // a unix socket: one client
	}
	return ap.Addr().Unmap().WithZone("")
}

// clientOf is the client a connection from a counts against: its IPv4
// address, or its IPv6 address's /64 (as proxy.ClientOf: one host's or one
// network's, which its holder may spread over 2^64 addresses). Found by
// review, 2026-12-04: counted by whole address, one IPv6 client took a
// listener's 32,768 connections from as many addresses of its /64, and
// every other client's were closed at once.
func clientOf(a netip.Addr) netip.Addr {
	if a.Is6() {
		if p, err := a.Prefix(64); err == nil {
			return p.Addr()
		}
	}
	return a
}

type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// newServer is an http.Server with the daemon's bounds; api servers also
// bound the time to read a whole request.
//
// Each write of an answer must get through within a bound (the proxy sets
// its own; the others get proxy.WriteProgress): a client that reads
// nothing holds a handler for that long, not for good. HTTP/2 (the
// proxy's) is held to 100 streams a connection, frames of 64 KiB and
// 256 KiB of unread body a stream, 1 MiB a connection: an HTTP/1
// connection costs some 10 KiB, and the connection caps were sized for
// that (a 1 MiB frame once made a connection's read buffer 1 MiB for its
// life).
func newServer(h http.Handler, api bool) *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	if !api {
		protos.SetUnencryptedHTTP2(true)
	} else {
		h = proxy.WriteProgress(h)
	}
	s := &http.Server{Handler: h, Protocols: &protos, ReadHeaderTimeout: HeaderTimeout, IdleTimeout: IdleTimeout,
		MaxHeaderBytes: maxHeaderBytes,
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 100, MaxReadFrameSize: 64 << 10,
			MaxReceiveBufferPerStream: 256 << 10, MaxReceiveBufferPerConnection: 1 << 20}}
	if api {
		s.ReadTimeout = apiReadTimeout
	}
	return s
}
