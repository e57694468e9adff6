package channel

import (
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// Agent is the agent's end of a channel: a net.Listener whose connections
// are the streams the host opens. It connects to the host's socket, and
// again whenever the session ends (the host went away), until closed.
type Agent struct {
	path string // the host's socket, through the directory's descriptor
	dir  *os.File
	key  []byte

	mu     sync.Mutex
	sess   *yamux.Session
	closed chan struct{}
	once   sync.Once
}

// Reconnection waits grow from retryMin to retryMax: a host that restarts
// (a daemon adopting the sandbox) is reached within retryMax of listening.
const (
	retryMin = 2 * time.Millisecond
	retryMax = 100 * time.Millisecond
)

// Connect returns the agent's end of the channel whose host listens on
// name in dir, a descriptor of the directory opened before any command
// could exist (a path would be resolved again at each reconnection, and
// root inside might by then have moved a directory of its own there). The
// first session is made before Connect returns.
func Connect(dir *os.File, name string, key []byte) (*Agent, error) {
	a := &Agent{path: "/proc/self/fd/" + strconv.Itoa(int(dir.Fd())) + "/" + name, dir: dir, key: key,
		closed: make(chan struct{})}
	deadline := time.Now().Add(handshakeTimeout)
	for wait := retryMin; ; wait = min(2*wait, retryMax) {
		sess, err := a.connect()
		if err == nil {
			a.sess = sess
			return a, nil
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(wait)
	}
}

// connect makes one session with the host.
func (a *Agent) connect() (*yamux.Session, error) {
	c, err := net.DialTimeout("unix", a.path, handshakeTimeout)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	if err := respond(c, a.key); err != nil {
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	sess, err := yamux.Server(c, SessionConfig())
	if err != nil {
		c.Close()
		return nil, err
	}
	return sess, nil
}

// session returns the live session, connecting again (and waiting as long
// as it takes) if the last one has ended.
func (a *Agent) session() (*yamux.Session, error) {
	a.mu.Lock()
	sess := a.sess
	a.mu.Unlock()
	for wait := retryMin; sess == nil || sess.IsClosed(); wait = min(2*wait, retryMax) {
		select {
		case <-a.closed:
			return nil, net.ErrClosed
		default:
		}
		var err error
		if sess, err = a.connect(); err != nil {
			sess = nil
			select {
			case <-a.closed:
				return nil, net.ErrClosed
			case <-time.After(wait):
			}
			continue
		}
		a.mu.Lock()
		a.sess = sess
		a.mu.Unlock()
	}
	return sess, nil
}

// Accept waits for the host's next connection.
func (a *Agent) Accept() (net.Conn, error) {
	for {
		sess, err := a.session()
		if err != nil {
			return nil, err
		}
		c, err := sess.Accept()
		if err == nil {
			return c, nil
		}
		if a.isClosed() {
			return nil, net.ErrClosed
		}
		sess.Close() // ended: the next Accept connects again
	}
}

func (a *Agent) isClosed() bool {
	select {
	case <-a.closed:
		return true
	default:
		return false
	}
}

// Close ends the session and stops reconnecting.
func (a *Agent) Close() error {
	a.once.Do(func() { close(a.closed) })
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.sess != nil {
		a.sess.Close()
	}
	return nil
}

// Addr is the host's socket.
func (a *Agent) Addr() net.Addr { return &net.UnixAddr{Name: a.path, Net: "unix"} }
