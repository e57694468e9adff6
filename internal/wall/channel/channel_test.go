package channel

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// pair makes a host listening in a directory of the test's and an agent
// connected to it; the agent echoes every connection.
func pair(t *testing.T) (h *Host, a *Agent, sock string, key []byte) {
	t.Helper()
	dir := t.TempDir()
	sock = filepath.Join(dir, "host.sock")
	key, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	if h, err = Listen(sock, key, os.Getuid()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if a, err = Connect(d, "host.sock", key); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	go func() {
		for {
			c, err := a.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return h, a, sock, key
}

func echo(t *testing.T, h *Host, msg string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := h.Dial(ctx, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || line != msg+"\n" {
		t.Fatalf("echo of %q: %q, %v", msg, line, err)
	}
}

// TestChannel: streams the host opens reach the agent, many at once.
func TestChannel(t *testing.T) {
	h, _, sock, _ := pair(t)
	for i := 0; i < 20; i++ {
		echo(t, h, strings.Repeat("x", i))
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the host's socket: %v %v, want mode 0600", fi.Mode(), err)
	}
}

// TestChannelImpostor: something else in the sandbox (root inside can
// connect to the host's socket) that does not hold the key gets no
// session, whatever it answers, and the agent's session goes on; a flood
// of such connections does not keep the agent out.
func TestChannelImpostor(t *testing.T) {
	h, _, sock, _ := pair(t)
	answers := []string{"\n", strings.Repeat("0", 64) + "\n", strings.Repeat("ab", 32) + "\n", strings.Repeat("z", 10000)}
	for _, ans := range answers {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, greeting+" ") {
			t.Fatalf("greeting: %q %v", line, err)
		}
		_, _ = io.WriteString(c, ans)
		// The host hangs up: the impostor's connection never becomes a
		// session (a yamux client would open streams on it).
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := br.Read(make([]byte, 1)); n != 0 || err == nil || os.IsTimeout(err) {
			t.Errorf("after answer %.20q the host sent %d bytes (%v), want a hang-up", ans, n, err)
		}
		c.Close()
	}
	// A key of its own (root inside guessing) is no better: the host hangs
	// up on the session it thinks it made.
	other, _ := NewKey()
	d, err := os.Open(filepath.Dir(sock))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	fake := &Agent{path: "/proc/self/fd/" + strconv.Itoa(int(d.Fd())) + "/host.sock", key: other}
	if sess, err := fake.connect(); err == nil {
		select {
		case <-sess.CloseChan():
		case <-time.After(5 * time.Second):
			t.Error("the host kept a session with a peer of another key")
		}
	}
	var held []net.Conn
	for i := 0; i < 3*maxPending; i++ {
		if c, err := net.Dial("unix", sock); err == nil {
			held = append(held, c) // silent: each holds a handshake slot
		}
	}
	echo(t, h, "still the agent")
	for _, c := range held {
		c.Close()
	}
}

// TestChannelReconnect: a host that goes away (a daemon killed) and a new
// one listening in its place (the daemon that adopts the sandbox): the
// agent connects to the new one by itself, and streams flow again.
func TestChannelReconnect(t *testing.T) {
	h, _, sock, key := pair(t)
	echo(t, h, "first host")
	h.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := h.Dial(ctx, nil); err != ErrClosed {
		t.Errorf("dial of a closed host: %v, want ErrClosed", err)
	}
	h2, err := Listen(sock, key, os.Getuid())
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	echo(t, h2, "second host")
}

// TestChannelGone: Dial gives up when the sandbox is gone or ctx ends,
// rather than waiting for an agent that never comes.
func TestChannelGone(t *testing.T) {
	key, _ := NewKey()
	h, err := Listen(filepath.Join(t.TempDir(), "host.sock"), key, os.Getuid())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	gone := make(chan struct{})
	close(gone)
	if _, err := h.Dial(context.Background(), gone); err == nil || !strings.Contains(err.Error(), "gone") {
		t.Errorf("dial with the sandbox gone: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := h.Dial(ctx, nil); err != context.DeadlineExceeded {
		t.Errorf("dial with no agent: %v, want the deadline", err)
	}
}

// TestChannelAgentStreams: streams an agent opens towards the host (a
// compromised one, to make the host buffer what it sends) are refused.
func TestChannelAgentStreams(t *testing.T) {
	h, a, _, _ := pair(t)
	echo(t, h, "before")
	sess, err := a.session()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		s, err := sess.Open()
		if err != nil {
			continue // refused outright: nothing sent
		}
		_ = s.SetWriteDeadline(time.Now().Add(200 * time.Millisecond))
		n, _ := s.Write(make([]byte, 1<<20))
		s.Close()
		if n > 0 {
			t.Fatalf("the host took %d bytes on a stream the agent opened", n)
		}
	}
	echo(t, h, "after")
}

// TestClosedStreamsBounded: an agent that answers each stream with data
// and never closes it (a sandbox's server behind the proxy) holds the
// host's closed streams, and what it sent on them, only until
// StreamCloseTimeout; and no more than maxStreams are open to one sandbox
// at once, the next dial refused. Found by review, 2026-12-05: yamux's
// 5 min kept 200 such streams and 50 MiB of the daemon's per 200 requests.
func TestClosedStreamsBounded(t *testing.T) {
	old := streamCloseTimeout
	streamCloseTimeout = 500 * time.Millisecond
	defer func() { streamCloseTimeout = old }()
	dir := t.TempDir()
	key, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	h, err := Listen(filepath.Join(dir, "host.sock"), key, os.Getuid())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	a, err := Connect(d, "host.sock", key)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	var held []net.Conn // the agent's ends, never closed
	var mu sync.Mutex
	go func() {
		for {
			c, err := a.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			answer := len(held) <= 50 // the first phase's; the rest stay quiet
			mu.Unlock()
			if answer {
				go func() { _, _ = c.Write(make([]byte, 250<<10)) }()
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	for range 50 {
		c, err := h.Dial(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Read(make([]byte, 1)) // the answer has begun
		c.Close()
	}
	sess := func() *yamux.Session { h.mu.Lock(); defer h.mu.Unlock(); return h.sess }()
	deadline := time.Now().Add(10 * time.Second)
	for sess.NumStreams() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := sess.NumStreams(); n > 0 {
		t.Fatalf("%d streams the host closed still held 10 s after their close", n)
	}
	t.Logf("50 closed streams gone %v after the first was opened", time.Since(start).Round(time.Millisecond))

	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for range maxStreams {
		c, err := h.Dial(ctx, nil)
		if err != nil {
			t.Fatalf("dial %d of %d: %v", len(open)+1, maxStreams, err)
		}
		open = append(open, c)
	}
	if c, err := h.Dial(ctx, nil); !errors.Is(err, ErrTooManyStreams) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("dial past %d streams: %v, want ErrTooManyStreams", maxStreams, err)
	}
	open[0].Close()
	deadline = time.Now().Add(10 * time.Second)
	for sess.NumStreams() >= maxStreams && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if c, err := h.Dial(ctx, nil); err != nil {
		t.Errorf("dial once a stream ended: %v", err)
	} else {
		open = append(open, c)
	}
}
