package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime/debug"
	"strings"
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

// TestUpgradeMismatchClosesSandboxEnd: a sandbox's server that answers an
// upgrade with 101 for another protocol than the one asked for, or for
// none, gets its client the proxy's 502 that says so, and the connection
// the proxy opened to it is closed with the request. Before (found by
// review, 2026-12-05): net/http's reverse proxy refused such a switch
// without closing the sandbox's end, and the proxy stopped that end's
// idle watch, so each such answer left a connection through the agent
// open for as long as the sandbox lived, outside every in-flight bound
// (through the channel, 200 of them held 200 yamux streams and 153 MiB
// of the daemon, what the server sent after its switch).
func TestUpgradeMismatchClosesSandboxEnd(t *testing.T) {
	// No collector: a connection left open is not closed by a finalizer
	// while the test looks.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	a := newFakeAgent(t)
	closed := make(chan string, 4)
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/other" {
			w.Header().Set("Connection", "Upgrade")
			w.Header().Set("Upgrade", "other")
		}
		w.WriteHeader(http.StatusSwitchingProtocols)
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_ = brw.Flush()
		// What a server sends after its switch waits in the proxy's
		// buffers until the connection is closed.
		_, _ = c.Write(make([]byte, 32<<10))
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = io.Copy(io.Discard, c)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			closed <- r.URL.Path + ": still open after 5 s"
			return
		}
		closed <- ""
	})
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	for _, path := range []string{"/other", "/none"} {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("X-Access-Token", "the-token")
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", "websocket")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "another protocol") {
			t.Errorf("%s: %d %s, want 502: another protocol", path, resp.StatusCode, body)
		}
		if msg := <-closed; msg != "" {
			t.Errorf("the proxy's connection to the sandbox's server, %s", msg)
		}
	}
}
