package proxy

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// upgradeIdle closes an upgraded connection (a WebSocket, or any protocol a
// sandbox's server switches to) through which no byte has passed, either
// way, for this long: without it, anyone who reaches a public port held
// the connection to the client, the one through the agent and a request of
// the sandbox's in-flight budget for good. A variable for the tests.
var upgradeIdle = 10 * time.Minute

// idleWatch closes the two ends of an upgraded connection once no byte has
// been read from either for its idle time. Every byte written was read
// from the other end first, so reads count both directions; a write that
// never gets through (a peer that reads nothing) stops the reads behind it,
// and the watch closes it too.
type idleWatch struct {
	idle time.Duration
	last atomic.Int64 // when a byte was last read, either end (UnixNano)

	mu      sync.Mutex
	timer   *time.Timer
	ends    []io.Closer
	stopped bool
}

func newIdleWatch(idle time.Duration) *idleWatch {
	w := &idleWatch{idle: idle}
	w.touch()
	w.timer = time.AfterFunc(idle, w.check)
	return w
}

func (w *idleWatch) touch() { w.last.Store(time.Now().UnixNano()) }

// check closes the ends if the connection has been idle long enough, and
// otherwise looks again when it would have been.
func (w *idleWatch) check() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	if left := time.Until(time.Unix(0, w.last.Load()).Add(w.idle)); left > 0 {
		w.timer.Reset(left)
		return
	}
	w.stopped = true
	for _, c := range w.ends {
		_ = c.Close()
	}
}

// watch adds an end to close; one added after the watch fired is closed now.
func (w *idleWatch) watch(c io.Closer) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		_ = c.Close()
		return
	}
	w.ends = append(w.ends, c)
}

// stop ends the watch (the connection is over).
func (w *idleWatch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	w.timer.Stop()
}

// end ends the watch and closes its ends (the connection is over; an end
// closed already is closed again, to no effect).
func (w *idleWatch) end() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	w.timer.Stop()
	for _, c := range w.ends {
		_ = c.Close()
	}
	w.ends = nil
}

// clientEnd is the client's hijacked connection, watched.
func (w *idleWatch) clientEnd(c net.Conn) net.Conn {
	w.watch(c)
	return &idleConn{Conn: c, w: w}
}

// sandboxEnd is the sandbox's side (the 101 answer's body), watched.
func (w *idleWatch) sandboxEnd(rwc io.ReadWriteCloser) io.ReadWriteCloser {
	w.watch(rwc)
	return &idleRWC{ReadWriteCloser: rwc, w: w}
}

type idleConn struct {
	net.Conn
	w *idleWatch
}

func (c *idleConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.w.touch()
	}
	return n, err
}

// CloseWrite half-closes where the connection can (httputil's copier
// passes the sandbox's end of stream on so), else closes.
func (c *idleConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}

type idleRWC struct {
	io.ReadWriteCloser
	w *idleWatch
}

func (c *idleRWC) Read(p []byte) (int, error) {
	n, err := c.ReadWriteCloser.Read(p)
	if n > 0 {
		c.w.touch()
	}
	return n, err
}

// closerFunc is a function as an io.Closer (an idle watch's action).
type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// touchingBody is a body whose bytes keep a watch from firing.
type touchingBody struct {
	io.ReadCloser
	w *idleWatch
}

func (b *touchingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.w.touch()
	}
	return n, err
}
