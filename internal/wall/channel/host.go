package channel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// maxPending bounds the handshakes under way at once: whatever else in the
// sandbox connects (root inside can) costs the host at most this many
// connections at a time, each for at most handshakeTimeout.
const maxPending = 8

// maxStreams bounds the streams open to one sandbox at once, those closed
// by the host and not yet by the agent included (see SessionConfig's
// StreamCloseTimeout): each may hold the agent's window (256 KiB) of the
// daemon's memory. Above the proxy's requests in flight to one sandbox
// (1,024) with the agent's own calls beside them.
const maxStreams = 2048

// ErrTooManyStreams says a sandbox has maxStreams streams open.
var ErrTooManyStreams = fmt.Errorf("channel: the sandbox has %d connections open", maxStreams)

// Host is the host's end of a channel: a listening socket and, once the
// agent has connected and proved itself, a session to it.
type Host struct {
	l       *net.UnixListener
	key     []byte
	pending chan struct{} // a slot per handshake under way

	mu      sync.Mutex
	sess    *yamux.Session
	changed chan struct{} // closed (and replaced) when sess changes
	closed  bool
}

// Listen makes the host's socket at path, whose directory only the host
// may write (the sandbox sees it read-only): a file there already is a
// socket an earlier host of this sandbox left, and is replaced. The
// socket is uid's (the agent's, as the sandbox sees it), 0600: nothing
// else in the sandbox may connect to it, root inside included (no
// command holds CAP_DAC_OVERRIDE); gVisor lets the sealed agent connect
// only to a socket it owns.
func Listen(path string, key []byte, uid int) (*Host, error) {
	if len(key) != KeyBytes {
		return nil, fmt.Errorf("channel: a key of %d bytes, want %d", len(key), KeyBytes)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("channel: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	if err := os.Lchown(path, uid, uid); err != nil {
		l.Close()
		return nil, err
	}
	h := &Host{l: l, key: key, pending: make(chan struct{}, maxPending), changed: make(chan struct{})}
	go h.accept()
	return h, nil
}

func (h *Host) accept() {
	for {
		c, err := h.l.Accept()
		if err != nil {
			return // closed
		}
		select {
		case h.pending <- struct{}{}:
			go h.handshake(c)
		default:
			c.Close() // a flood of connections: not the agent's
		}
	}
}

// handshake takes c as the session to the agent if its peer holds the key.
func (h *Host) handshake(c net.Conn) {
	defer func() { <-h.pending }()
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	if err := challenge(c, h.key); err != nil {
		c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	sess, err := Client(c)
	if err != nil {
		c.Close()
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		sess.Close()
		return
	}
	// Only the agent holds the key: a new session is the agent's again,
	// whose old one has ended (or is about to).
	if h.sess != nil {
		h.sess.Close()
	}
	h.sess = sess
	close(h.changed)
	h.changed = make(chan struct{})
}

// ErrClosed is Dial's error once the host's end is closed.
var ErrClosed = errors.New("channel closed")

// Dial opens a connection to the agent: a stream of the session, once the
// agent has connected. It waits for the agent until ctx ends or gone is
// closed (the sandbox has ended).
func (h *Host) Dial(ctx context.Context, gone <-chan struct{}) (net.Conn, error) {
	for {
		h.mu.Lock()
		sess, changed, closed := h.sess, h.changed, h.closed
		h.mu.Unlock()
		if closed {
			return nil, ErrClosed
		}
		if sess != nil {
			if sess.NumStreams() >= maxStreams {
				return nil, ErrTooManyStreams
			}
			c, err := sess.Open()
			if err == nil {
				return c, nil
			}
			if !sess.IsClosed() {
				return nil, fmt.Errorf("channel: %w", err)
			}
			// The session ended (the agent reconnects): wait for the next.
		}
		select {
		case <-changed:
		case <-gone:
			return nil, errors.New("the sandbox is gone")
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Close stops listening and ends the session. The socket file stays (its
// directory goes with the sandbox's state).
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	close(h.changed)
	err := h.l.Close()
	if h.sess != nil {
		h.sess.Close()
	}
	return err
}
