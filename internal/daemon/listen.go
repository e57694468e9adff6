package daemon

import (
	"context"
	"errors"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/logbound"
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
	// own holds the source ports of the daemon's own connections to this
	// listener (dialOwn) that it has not yet accepted.
	own sync.Map // uint16 -> struct{}

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
		// The daemon's own (dashboard, /mcp): every tenant's sessions come
		// from it. A few keys' held open must not fill the loopback
		// address's bound for all the others, nor count against the local
		// clients' (the operator's cage commands).
		own := !peer && l.ownConn(c)
		l.mu.Lock()
		ok := l.open < l.total && (own || peer || l.client[addr] < l.perClient)
		if ok {
			l.open++
			if !own {
				l.client[addr]++
			}
		}
		l.mu.Unlock()
		if !ok {
			c.Close()
			continue
		}
		if own {
			return &limitedConn{Conn: c, release: l.releaseOwn}, nil
		}
		return &limitedConn{Conn: c, release: func() { l.release(addr) }}, nil
	}
}

// dialFunc dials as net.Dialer.DialContext does.
type dialFunc = func(ctx context.Context, network, addr string) (net.Conn, error)

// dialOwn dials this listener (at addr) as the daemon itself: the
// connection's source port, bound before the connect, is remembered until
// the listener accepts it, and it is then held to the bound on all
// connections only, not counted as its address's. A port is the daemon's alone while its
// socket holds it (bound to every address of the host), and only a
// connection from this host (its source one of the host's addresses, the
// one it reached) is taken for the daemon's.
func (l *connLimiter) dialOwn(ctx context.Context, network, addr string) (net.Conn, error) {
	var ports []uint16 // one per attempt (a name of several addresses)
	d := net.Dialer{Control: func(network, _ string, rc syscall.RawConn) error {
		var err error
		cerr := rc.Control(func(fd uintptr) {
			var sa unix.Sockaddr = &unix.SockaddrInet4{}
			if network == "tcp6" {
				sa = &unix.SockaddrInet6{}
			}
			if err = unix.Bind(int(fd), sa); err != nil {
				return
			}
			var got unix.Sockaddr
			if got, err = unix.Getsockname(int(fd)); err != nil {
				return
			}
			var port uint16
			switch a := got.(type) {
			case *unix.SockaddrInet4:
				port = uint16(a.Port)
			case *unix.SockaddrInet6:
				port = uint16(a.Port)
			default:
				err = errors.New("not an IP socket")
				return
			}
			l.own.Store(port, struct{}{})
			ports = append(ports, port)
		})
		return errors.Join(cerr, err)
	}}
	c, err := d.DialContext(ctx, network, addr)
	// The attempts that did not connect are forgotten (a port of one of
	// them may be anyone's next).
	var kept uint16
	if err == nil {
		if ap, perr := netip.ParseAddrPort(c.LocalAddr().String()); perr == nil {
			kept = ap.Port()
		}
	}
	for _, p := range ports {
		if p != kept {
			l.own.Delete(p)
		}
	}
	return c, err
}

// ownConn says whether c is one of the daemon's own connections (dialOwn),
// and forgets its port.
func (l *connLimiter) ownConn(c net.Conn) bool {
	remote, ok1 := c.RemoteAddr().(*net.TCPAddr)
	local, ok2 := c.LocalAddr().(*net.TCPAddr)
	if !ok1 || !ok2 || remote.Port <= 0 || remote.Port > 65535 {
		return false
	}
	port := uint16(remote.Port)
	if _, ok := l.own.Load(port); !ok {
		return false
	}
	// From this host: a connection to one of its own addresses comes
	// from that address.
	if !remote.IP.Equal(local.IP) {
		return false
	}
	l.own.Delete(port)
	return true
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

// releaseOwn frees the place of one of the daemon's own connections.
func (l *connLimiter) releaseOwn() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
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
//
// Its error log (net/http's own lines: a failed TLS handshake, a broken
// HTTP/2 connection, a handler's panic) is the daemon's, bounded
// (serverLog): anyone who reaches a listener causes those lines.
func newServer(h http.Handler, api bool, log *slog.Logger) *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	if !api {
		protos.SetUnencryptedHTTP2(true)
	} else {
		h = proxy.WriteProgress(h)
	}
	s := &http.Server{Handler: h, Protocols: &protos, ReadHeaderTimeout: HeaderTimeout, IdleTimeout: IdleTimeout,
		MaxHeaderBytes: maxHeaderBytes, ErrorLog: serverLog(log),
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 100, MaxReadFrameSize: 64 << 10,
			MaxReceiveBufferPerStream: 256 << 10, MaxReceiveBufferPerConnection: 1 << 20}}
	if api {
		s.ReadTimeout = apiReadTimeout
	}
	return s
}

// serverLog is a listener's error log: net/http's lines go to the
// daemon's log as warnings, at most one a second, with how many were left
// out. Unset, each was a line of the standard logger, so that anyone who
// reached the proxy's TLS listener wrote one (with the server name it
// chose) for each handshake it failed, filling the host's log and the
// journal's rate limit that the daemon's own lines share (found by
// review, 2026-12-04).
func serverLog(log *slog.Logger) *stdlog.Logger {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return stdlog.New(&boundedLog{log: log}, "", 0)
}

// boundedLog writes at most a line a second to log.
type boundedLog struct {
	log   *slog.Logger
	limit logbound.Limiter
}

func (b *boundedLog) Write(p []byte) (int, error) {
	ok, skipped := b.limit.Allow("")
	if !ok {
		return len(p), nil
	}
	msg := strings.TrimSpace(string(p))
	if len(msg) > maxServerLogLine {
		msg = msg[:maxServerLogLine] + "…(cut)"
	}
	b.log.Warn("listener", "err", msg, "not_logged_before", skipped)
	return len(p), nil
}

// maxServerLogLine bounds a line of net/http's (a panic's stack fits).
const maxServerLogLine = 16 << 10

// boundStandardLog sends the standard logger's lines (net/http's, from a
// reverse proxy or server without an error log of its own, as the
// cluster front's) to log, bounded as serverLog's, until restore. Found by
// review, 2026-12-04: such a line was written for each relayed answer
// that broke off, a sandbox's doing, straight to stderr.
func boundStandardLog(log *slog.Logger) (restore func()) {
	w, flags, prefix := stdlog.Writer(), stdlog.Flags(), stdlog.Prefix()
	stdlog.SetOutput(&boundedLog{log: log})
	stdlog.SetFlags(0)
	stdlog.SetPrefix("")
	return func() {
		stdlog.SetOutput(w)
		stdlog.SetFlags(flags)
		stdlog.SetPrefix(prefix)
	}
}
