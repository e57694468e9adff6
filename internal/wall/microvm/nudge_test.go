package microvm

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/cagehq/cage/internal/wall/channel"
)

// frameLog records the yamux frame types that cross a connection (each
// write of yamux's is one frame's header, or a body).
type frameLog struct {
	net.Conn
	mu    sync.Mutex
	pings int
}

func (f *frameLog) Write(b []byte) (int, error) {
	// A header: version 0, type, flags, stream id, length. A ping is type 2
	// on stream 0 with SYN (a request) or ACK (an answer).
	if len(b) == 12 && b[0] == 0 && b[1] == 2 {
		f.mu.Lock()
		f.pings++
		f.mu.Unlock()
	}
	return f.Conn.Write(b)
}

func (f *frameLog) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pings
}

// TestNudge: the host pings the guest while a stream is open, about once
// per nudgeEvery, and not at all while none is (an idle or pooled sandbox
// costs nothing); it stops when the session ends.
func TestNudge(t *testing.T) {
	hostEnd, guestEnd := net.Pipe()
	host := &frameLog{Conn: hostEnd}
	guest, err := yamux.Server(guestEnd, channel.SessionConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer guest.Close()
	sess, err := channel.Client(host)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			s, err := guest.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, s) }()
		}
	}()
	done := make(chan struct{})
	go func() { nudge(sess); close(done) }()

	time.Sleep(3 * nudgeEvery)
	if n := host.count(); n != 0 {
		t.Errorf("%d pings with no stream open, want none", n)
	}
	st, err := sess.Open()
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * nudgeEvery)
	for host.count() < 2 && time.Now().Before(deadline) {
		time.Sleep(nudgeEvery / 10)
	}
	if n := host.count(); n < 2 {
		t.Errorf("%d pings in %v with a stream open, want at least 2", n, 20*nudgeEvery)
	}
	st.Close()
	sess.Close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("nudge goes on after the session ended")
	}
}
