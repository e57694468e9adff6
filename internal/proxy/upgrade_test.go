package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// upgraded answers 101 and then, on the raw connection: "sink" reads and
// drops what comes, "tick" sends a byte every 50 ms, anything else does
// nothing until the connection is closed.
func upgraded(w http.ResponseWriter, mode string) {
	w.Header().Set("Connection", "Upgrade")
	w.Header().Set("Upgrade", "test")
	w.WriteHeader(http.StatusSwitchingProtocols)
	c, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer c.Close()
	_ = brw.Flush()
	switch mode {
	case "tick":
		for {
			if _, err := c.Write([]byte{'.'}); err != nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	default:
		_, _ = io.Copy(io.Discard, c)
	}
}

// TestUpgradeIdleTimeout: an upgraded connection (a WebSocket) through
// which nothing passes either way is closed by the proxy after
// upgradeIdle; one kept busy in either direction alone is not. Before,
// an idle one was held for good: anyone who reaches a public port could
// hold the proxy's connections and the sandbox's in-flight budget so.
func TestUpgradeIdleTimeout(t *testing.T) {
	defer func(d time.Duration) { upgradeIdle = d }(upgradeIdle)
	// Long enough beside the writes and ticks that keep a connection busy
	// (a tenth of it apart) for a loaded host's scheduling not to leave a
	// gap of its length.
	upgradeIdle = 1500 * time.Millisecond
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	open := func(t *testing.T, mode string) (net.Conn, *bufio.Reader) {
		t.Helper()
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.WriteString(c, "GET /upgrade?mode="+mode+" HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: sandbox1\r\n"+
			"X-Access-Token: the-token\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("%s: %d, want 101", mode, resp.StatusCode)
		}
		return c, br
	}
	// closedAfter reads until the proxy closes the connection and says
	// how long after start it did.
	closedAfter := func(t *testing.T, c net.Conn, br *bufio.Reader, start time.Time) time.Duration {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		for {
			if _, err := br.ReadByte(); err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Fatalf("an upgraded connection idle for 10 s is still open (idle timeout %v)", upgradeIdle)
				}
				return time.Since(start)
			}
		}
	}

	t.Run("idle", func(t *testing.T) {
		c, br := open(t, "quiet")
		if d := closedAfter(t, c, br, time.Now()); d < upgradeIdle*8/10 {
			t.Errorf("closed after %v, before its idle time %v", d, upgradeIdle)
		}
	})
	t.Run("client talks", func(t *testing.T) {
		c, br := open(t, "sink")
		start := time.Now()
		for time.Since(start) < 2*upgradeIdle {
			if _, err := c.Write([]byte{'x'}); err != nil {
				t.Fatalf("writing after %v: %v", time.Since(start), err)
			}
			time.Sleep(upgradeIdle / 10)
		}
		quiet := time.Now()
		if d := closedAfter(t, c, br, quiet); d < upgradeIdle*8/10 {
			t.Errorf("closed %v after the client's last byte, want its idle time %v", d, upgradeIdle)
		}
	})
	p := srv.Config.Handler.(*Proxy)
	t.Run("sandbox talks", func(t *testing.T) {
		c, br := open(t, "tick")
		start := time.Now()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		for time.Since(start) < 2*upgradeIdle {
			if _, err := br.ReadByte(); err != nil {
				t.Fatalf("reading after %v: %v (the sandbox's bytes keep it open)", time.Since(start), err)
			}
		}
		// The closed ones have let go of their places in the sandbox's
		// budget; this busy one, still open (checked before the
		// subtest's cleanup closes it), holds its own.
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			p.mu.Lock()
			n := p.inFlight[flightKey{"sandbox1", true}]
			p.mu.Unlock()
			if n == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d requests in flight, want the one still busy", n)
			}
		}
	})
}
