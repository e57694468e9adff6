package proxy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// portShim is a connection to a sandbox's server as the agent's port
// forward gives it: it answers the CONNECT itself (200), then passes
// bytes through.
type portShim struct {
	net.Conn
	mu      sync.Mutex
	head    []byte // the CONNECT's head, until it is whole
	done    bool
	pending []byte // the CONNECT's answer, not yet read
}

func (c *portShim) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.done {
		c.mu.Unlock()
		return c.Conn.Write(p)
	}
	c.head = append(c.head, p...)
	i := bytes.Index(c.head, []byte("\r\n\r\n"))
	if i < 0 {
		c.mu.Unlock()
		return len(p), nil
	}
	rest := c.head[i+4:]
	c.done, c.head, c.pending = true, nil, []byte("HTTP/1.1 200 OK\r\n\r\n")
	c.mu.Unlock()
	if len(rest) > 0 {
		if _, err := c.Conn.Write(rest); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

func (c *portShim) Read(p []byte) (int, error) {
	c.mu.Lock()
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		c.mu.Unlock()
		return n, nil
	}
	c.mu.Unlock()
	return c.Conn.Read(p)
}

// portSandbox is a sandbox with one server behind every port but the
// agent's (a test server reached through portShim).
type portSandbox struct {
	sb
	server string
}

func (s portSandbox) Dial(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", s.server)
	if err != nil {
		return nil, err
	}
	return &portShim{Conn: c}, nil
}

// portServer is a sandbox's server: /read reads the body and answers
// how many bytes it got, /silent never answers, /tick?n=N sends a byte
// every tick, N times.
func portServer(t *testing.T, tick time.Duration) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/read":
			n, _ := io.Copy(io.Discard, r.Body)
			fmt.Fprint(w, n)
		case "/silent":
			<-r.Context().Done()
		case "/tick":
			n, _ := strconv.Atoi(r.URL.Query().Get("n"))
			w.WriteHeader(http.StatusOK)
			for range n {
				if _, err := w.Write([]byte{'.'}); err != nil {
					return
				}
				_ = http.NewResponseController(w).Flush()
				time.Sleep(tick)
			}
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// inFlight is the number of requests relayed to sandbox1 of a class.
func (p *Proxy) inFlightOf(owner bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.inFlight[flightKey{"sandbox1", owner}]
}

// TestRelayIdleTimeout: an anonymous request to a public port through
// which nothing passes either way (a body announced and never sent, to a
// server that waits for it; a server that never answers) is ended after
// relayIdle and leaves the sandbox's budget; one kept busy by the client
// alone (a slow upload) or by the sandbox alone (a stream) is not, nor is
// one that carries the sandbox's traffic token. Before, an idle one was
// held for good: anyone could fill a public sandbox's anonymous budget
// with them, and its ports answered 429 to everyone else.
func TestRelayIdleTimeout(t *testing.T) {
	defer func(d time.Duration) { relayIdle = d }(relayIdle)
	// Long enough beside the bytes that keep a request busy (a tenth of
	// it apart) for a loaded host's scheduling not to leave a gap of its
	// length.
	relayIdle = 1500 * time.Millisecond
	a := newFakeAgent(t)
	ps := portServer(t, relayIdle/10)
	p := New(public{sandboxes{portSandbox{sb{a}, ps.Listener.Addr().String()}}}, "", nil)
	srv := httptest.NewServer(p)
	defer srv.Close()
	send := func(t *testing.T, head string) (net.Conn, *bufio.Reader) {
		t.Helper()
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.WriteString(c, head); err != nil {
			t.Fatal(err)
		}
		return c, bufio.NewReader(c)
	}
	// endedAfter reads until the proxy ends the request (closes the
	// connection, or answers it with an error) and says how long after
	// start it did.
	endedAfter := func(t *testing.T, c net.Conn, br *bufio.Reader, start time.Time) time.Duration {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			if err == nil && resp.StatusCode < 400 {
				t.Fatalf("an idle request answered %d", resp.StatusCode)
			}
		}
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("a request idle for 10 s is still open (idle timeout %v)", relayIdle)
		}
		return time.Since(start)
	}
	head := func(method, path, extra string) string {
		return method + " " + path + " HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: sandbox1\r\nE2b-Sandbox-Port: 8000\r\n" + extra + "\r\n"
	}

	t.Run("body held back", func(t *testing.T) {
		start := time.Now()
		c, br := send(t, head("POST", "/read", "Content-Length: 10\r\n"))
		if d := endedAfter(t, c, br, start); d < relayIdle*8/10 {
			t.Errorf("ended after %v, before its idle time %v", d, relayIdle)
		}
	})
	t.Run("no answer", func(t *testing.T) {
		start := time.Now()
		c, br := send(t, head("GET", "/silent", ""))
		if d := endedAfter(t, c, br, start); d < relayIdle*8/10 {
			t.Errorf("ended after %v, before its idle time %v", d, relayIdle)
		}
	})
	for deadline := time.Now().Add(10 * time.Second); p.inFlightOf(false) != 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d anonymous requests in flight after the idle ones ended, want 0", p.inFlightOf(false))
		}
	}
	t.Run("slow upload", func(t *testing.T) {
		const n = 30 // 3 idle times
		c, br := send(t, head("POST", "/read", "Content-Length: "+strconv.Itoa(n)+"\r\n"))
		for i := range n {
			if _, err := c.Write([]byte{'x'}); err != nil {
				t.Fatalf("byte %d: %v (a body that makes progress keeps its request)", i, err)
			}
			time.Sleep(relayIdle / 10)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || string(got) != strconv.Itoa(n) {
			t.Errorf("a slow upload: %d %q, want 200 %q", resp.StatusCode, got, strconv.Itoa(n))
		}
	})
	t.Run("stream", func(t *testing.T) {
		const n = 30
		c, br := send(t, head("GET", "/tick?n="+strconv.Itoa(n), ""))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		got, err := io.ReadAll(resp.Body)
		if err != nil || len(got) != n {
			t.Errorf("a stream of %d bytes a tenth of the idle time apart: %d bytes, %v", n, len(got), err)
		}
	})
	t.Run("owner", func(t *testing.T) {
		c, br := send(t, head("GET", "/silent", TrafficHeader+": traffic\r\n"))
		_ = c.SetReadDeadline(time.Now().Add(2 * relayIdle))
		if _, err := br.ReadByte(); err == nil {
			t.Fatal("the sandbox's silent server answered")
		} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			t.Errorf("a request with the traffic token ended within twice the idle time: %v", err)
		}
	})
}

// TestAnonymousSharePerClient: one client (an address) holds at most
// maxAnonymousPerClient of a sandbox's anonymous requests at once; the
// next from it gets 429, while another client's and the owner's pass.
// Before, one address could take all 1024.
func TestAnonymousSharePerClient(t *testing.T) {
	defer func(n, m int) { maxInFlightPerSandbox, maxAnonymousPerClient = n, m }(maxInFlightPerSandbox, maxAnonymousPerClient)
	maxInFlightPerSandbox, maxAnonymousPerClient = 16, 4
	a := newFakeAgent(t)
	ps := portServer(t, time.Millisecond)
	p := New(public{sandboxes{portSandbox{sb{a}, ps.Listener.Addr().String()}}}, "", nil)
	p.Client = func(r *http.Request) string { return r.Header.Get("X-Test-Client") } // "": by address
	srv := httptest.NewServer(p)
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 0, MaxIdleConnsPerHost: 32}}
	defer c.CloseIdleConnections()
	do := func(path string, h ...string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("E2b-Sandbox-Port", "8000")
		for i := 0; i+1 < len(h); i += 2 {
			req.Header.Set(h[i], h[i+1])
		}
		return c.Do(req)
	}
	for range maxAnonymousPerClient {
		go func() {
			if resp, err := do("/silent"); err == nil {
				resp.Body.Close()
			}
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); p.inFlightOf(false) != maxAnonymousPerClient; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d anonymous requests in flight, want %d", p.inFlightOf(false), maxAnonymousPerClient)
		}
	}
	status := func(path string, h ...string) int {
		t.Helper()
		resp, err := do(path, h...)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := status("/read"); got != http.StatusTooManyRequests {
		t.Errorf("one more anonymous request from the same address: %d, want 429", got)
	}
	if got := status("/read", "X-Test-Client", "another"); got != http.StatusOK {
		t.Errorf("another client's anonymous request: %d, want 200", got)
	}
	if got := status("/read", TrafficHeader, "traffic"); got != http.StatusOK {
		t.Errorf("the owner's request (traffic token): %d, want 200", got)
	}
	cancel()
	for deadline := time.Now().Add(10 * time.Second); p.inFlightOf(false) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d anonymous requests in flight after they ended", p.inFlightOf(false))
		}
	}
	p.mu.Lock()
	left := len(p.anonymous)
	p.mu.Unlock()
	if left != 0 {
		t.Errorf("%d clients still counted after their requests ended", left)
	}
}

// TestClientOf: a client is its IPv4 address, or its IPv6 address's /64.
func TestClientOf(t *testing.T) {
	for addr, want := range map[string]string{
		"192.0.2.7:5000":                 "192.0.2.7",
		"[::ffff:192.0.2.7]:5000":        "192.0.2.7",
		"[2001:db8:1:2:3:4:5:6]:443":     "2001:db8:1:2::/64",
		"[2001:db8:1:2:ffff::1]:443":     "2001:db8:1:2::/64",
		"[fe80::1%eth0]:80":              "fe80::/64",
		"@":                              "",
		strings.Repeat("x", 10) + ":abc": "",
	} {
		if got := ClientOf(&http.Request{RemoteAddr: addr}); got != want {
			t.Errorf("ClientOf(%q) = %q, want %q", addr, got, want)
		}
	}
}
