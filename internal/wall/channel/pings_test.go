package channel

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// pingFrames is n yamux ping frames asking for an answer (SYN).
func pingFrames(n int) []byte {
	b := make([]byte, 12*n)
	for i := range n {
		h := b[i*12:]
		h[1] = 2                             // ping
		binary.BigEndian.PutUint16(h[2:], 1) // SYN
		binary.BigEndian.PutUint32(h[8:], uint32(i))
	}
	return b
}

// TestPeerPingFlood: a peer (an agent or a microVM guest: not trusted)
// sending 100,000 pings and reading nothing has its session ended by the
// host after maxPeerPings, and the host holds no goroutine per ping
// (before: yamux answered each from a goroutine of its own waiting up to a
// minute for the wire: 400,000 goroutines and 1.3 GiB in under 3 s).
func TestPeerPingFlood(t *testing.T) {
	host, peer := net.Pipe()
	defer peer.Close()
	base := runtime.NumGoroutine()
	go func() { _, _ = io.Copy(io.Discard, io.LimitReader(peer, 12)) }() // the host's go-away, then nothing read
	sess, err := Client(host)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	go func() { _, _ = peer.Write(pingFrames(100_000)) }()
	select {
	case <-sess.CloseChan():
	case <-time.After(10 * time.Second):
		t.Fatal("the host's session still runs after 100,000 pings asked for")
	}
	time.Sleep(100 * time.Millisecond)
	if n := runtime.NumGoroutine() - base; n > 50 {
		t.Errorf("%d goroutines more than before the session", n)
	}
}

// TestHonestPeerUnaffected: a peer that sends no pings, data frames whose
// payload holds what reads as ping frames, and answers the host's own
// pings (a microVM's nudge) keeps its session.
func TestHonestPeerUnaffected(t *testing.T) {
	host, peer := net.Pipe()
	srv, err := yamux.Server(peer, SessionConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	go func() {
		for {
			c, err := srv.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	sess, err := Client(host)
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	for range 3 * maxPeerPings {
		if _, err := sess.Ping(); err != nil {
			t.Fatalf("the host's ping: %v", err)
		}
	}
	st, err := sess.Open()
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat(pingFrames(1), 40_000) // 480 KB that read as pings if taken for frames
	go func() { _, _ = st.Write(payload) }()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(st, got); err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("echo through the session: %v", err)
	}
	if sess.IsClosed() {
		t.Error("the honest peer's session was closed")
	}
}
