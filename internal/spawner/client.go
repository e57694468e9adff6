package spawner

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Client is the daemon's side: it starts the spawner at its first use, and
// again should the spawner have died.
type Client struct {
	path string // cage-agent
	log  *slog.Logger

	mu   sync.Mutex
	conn *conn // nil until started, or after the spawner died
}

// New returns a client that runs path (cage-agent) as the spawner.
func New(agentPath string, log *slog.Logger) *Client {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Client{path: agentPath, log: log}
}

// Child is a started process: its pid, a pidfd to watch and signal it by,
// and its end (closed without a value if the spawner died first: the
// pidfd still tells when it ends).
type Child struct {
	PID    int
	Pidfd  int
	Status <-chan syscall.WaitStatus
}

// Spawn starts req with files as its descriptors 0..len(files)-1. A fork
// that fails returns the kernel's error (a syscall.Errno where it has one).
func (c *Client) Spawn(req Request, files []uintptr) (*Child, error) {
	cn, err := c.connection()
	if err != nil {
		return nil, err
	}
	return cn.spawn(req, files)
}

// Close stops the spawner (the children it started live on).
func (c *Client) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		c.conn.close()
		c.conn = nil
	}
}

func (c *Client) connection() (*conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil && !c.conn.isDead() {
		return c.conn, nil
	}
	if c.conn != nil {
		c.log.Warn("the agent spawner died; starting it again")
	}
	cn, err := startSpawner(c.path)
	if err != nil {
		return nil, err
	}
	c.conn = cn
	return cn, nil
}

// conn is one running spawner.
type conn struct {
	// fd is the daemon's end of the socket. Its reader closes it once the
	// connection broke; a send or a shutdown holds fdMu for reading and
	// finds fd -1 after that. They used the number unguarded: one that
	// came after the close could reach what the number had become
	// meanwhile (a shutdown of another connection; a request, with the
	// host descriptors it carries, sent on another socket).
	fdMu sync.RWMutex
	fd   int
	proc *os.Process

	out     sync.Mutex // one request on the socket at a time
	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan answer
	ends    map[int]chan syscall.WaitStatus
	dead    error // set once the connection broke
}

type answer struct {
	r     reply
	pidfd int
	end   chan syscall.WaitStatus
}

func startSpawner(path string) (*conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	theirs := os.NewFile(uintptr(fds[1]), "spawner")
	defer theirs.Close()
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		unix.Close(fds[0])
		return nil, err
	}
	defer devnull.Close()
	// Its stderr is the daemon's: what it says when it fails is logged
	// where the daemon's own messages go.
	p, err := os.StartProcess(path, []string{"cage-agent", Arg}, &os.ProcAttr{
		Dir:   "/",
		Env:   []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Files: []*os.File{devnull, devnull, os.Stderr, theirs},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		unix.Close(fds[0])
		return nil, fmt.Errorf("start the agent spawner %s: %w", path, err)
	}
	cn := &conn{fd: fds[0], proc: p, pending: map[uint64]chan answer{}, ends: map[int]chan syscall.WaitStatus{}}
	go cn.read()
	go func() { _, _ = p.Wait() }()
	return cn, nil
}

func (cn *conn) isDead() bool {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.dead != nil
}

func (cn *conn) close() {
	cn.fdMu.RLock()
	defer cn.fdMu.RUnlock()
	if cn.fd >= 0 {
		unix.Shutdown(cn.fd, unix.SHUT_RDWR)
	}
}

func (cn *conn) spawn(req Request, files []uintptr) (*Child, error) {
	if len(files) > maxFiles {
		return nil, fmt.Errorf("spawner: %d descriptors, at most %d", len(files), maxFiles)
	}
	ch := make(chan answer, 1)
	cn.mu.Lock()
	if cn.dead != nil {
		cn.mu.Unlock()
		return nil, cn.dead
	}
	cn.nextID++
	req.ID = cn.nextID
	cn.pending[req.ID] = ch
	cn.mu.Unlock()
	req.Files = len(files)
	fds := make([]int, len(files))
	for i, f := range files {
		fds[i] = int(f)
	}
	cn.out.Lock()
	cn.fdMu.RLock()
	err := errClosed
	if cn.fd >= 0 {
		err = send(cn.fd, &req, fds)
	}
	cn.fdMu.RUnlock()
	cn.out.Unlock()
	if err != nil {
		cn.mu.Lock()
		delete(cn.pending, req.ID)
		cn.mu.Unlock()
		return nil, fmt.Errorf("spawner: %w", err)
	}
	a, ok := <-ch
	if !ok {
		return nil, errors.New("spawner: died before it answered")
	}
	if a.r.Err != "" {
		if a.r.Errno != 0 {
			return nil, syscall.Errno(a.r.Errno)
		}
		return nil, errors.New(a.r.Err)
	}
	return &Child{PID: a.r.PID, Pidfd: a.pidfd, Status: a.end}, nil
}

// read dispatches the spawner's answers and reports of ends until the
// connection breaks; then every waiter is let go.
func (cn *conn) read() {
	var err error
	rc := newReceiver()
	for {
		var r reply
		var files []int
		files, err = rc.recv(cn.fd, &r)
		if err != nil {
			break
		}
		cn.dispatch(r, files)
	}
	cn.mu.Lock()
	cn.dead = fmt.Errorf("spawner: %w", err)
	for id, ch := range cn.pending {
		close(ch)
		delete(cn.pending, id)
	}
	for pid, ch := range cn.ends {
		close(ch)
		delete(cn.ends, pid)
	}
	cn.mu.Unlock()
	// A send blocked on a live socket holds fdMu; the connection broke,
	// so it returns.
	cn.fdMu.Lock()
	unix.Close(cn.fd)
	cn.fd = -1
	cn.fdMu.Unlock()
}

func (cn *conn) dispatch(r reply, files []int) {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if r.Exit != 0 {
		closeAll(files)
		if ch, ok := cn.ends[r.Exit]; ok {
			ch <- syscall.WaitStatus(r.Status)
			close(ch)
			delete(cn.ends, r.Exit)
		}
		return
	}
	ch, ok := cn.pending[r.ID]
	if !ok {
		closeAll(files)
		return
	}
	delete(cn.pending, r.ID)
	a := answer{r: r, pidfd: -1}
	if r.Err == "" {
		if len(files) != 1 {
			closeAll(files)
			a.r.Err = "spawner: no pidfd in the answer"
		} else {
			a.pidfd = files[0]
			// Registered before the answer is handed on: the end is
			// reported after the answer, on the same socket.
			a.end = make(chan syscall.WaitStatus, 1)
			cn.ends[r.PID] = a.end
		}
	} else {
		closeAll(files)
	}
	ch <- a
}
