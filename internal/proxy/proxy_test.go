package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/filesig"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/wall"
)

// fakeAgent stands in for a sandbox's agent: it counts the connections the
// proxy makes to it and the request body bytes it receives.
type fakeAgent struct {
	dials     atomic.Int64
	requests  atomic.Int64
	bodyBytes atomic.Int64
	srv       *http.Server
	l         net.Listener
	exited    chan struct{}
	release   chan struct{} // closed: /hold answers
	holdOpen  atomic.Bool   // set: the open /health waits as /hold does
	bodyHeads atomic.Int64  // requests that came with a body
}

func newFakeAgent(t *testing.T) *fakeAgent {
	a := &fakeAgent{exited: make(chan struct{}), release: make(chan struct{})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a.l = l
	a.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.requests.Add(1)
		if r.ContentLength != 0 || len(r.TransferEncoding) > 0 {
			a.bodyHeads.Add(1)
		}
		if r.Method == http.MethodConnect { // every port in the sandbox is closed
			http.Error(w, "port is not open", http.StatusBadGateway)
			return
		}
		if r.URL.Path == "/hold" || (r.URL.Path == "/health" && a.holdOpen.Load()) { // answers once the test lets go
			w.WriteHeader(http.StatusOK)
			http.NewResponseController(w).Flush()
			<-a.release
			return
		}
		if r.URL.Path == "/late" { // answers once the test lets go, head and all
			<-a.release
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, "late")
			return
		}
		if r.URL.Path == "/upgrade" { // switches protocols, then as ?mode says
			upgraded(w, r.URL.Query().Get("mode"))
			return
		}
		if r.URL.Path == "/bighead" { // a head of 1 MiB
			for i := range 256 {
				w.Header().Set("X-Big-"+strconv.Itoa(i), strings.Repeat("v", 4096))
			}
			w.WriteHeader(http.StatusOK)
			return
		}
		if r.URL.Path == "/refuse" { // answers before reading the body, as a size limit does
			w.WriteHeader(http.StatusRequestEntityTooLarge)
			return
		}
		n, _ := io.Copy(io.Discard, r.Body)
		a.bodyBytes.Add(n)
		if r.URL.Path == "/health" {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		w.WriteHeader(http.StatusOK)
	})}
	go a.srv.Serve(l)
	t.Cleanup(func() { a.srv.Close(); close(a.exited); a.letGo() })
	return a
}

// sb is the wall.Sandbox of the fake agent.
type sb struct{ a *fakeAgent }

func (s sb) ID() string       { return "sandbox1" }
func (s sb) Token() string    { return "the-token" }
func (s sb) AgentPID() int    { return 0 }
func (s sb) Wall() string     { return "fake" }
func (s sb) Err() error       { return nil }
func (s sb) DiskPath() string { return "" }
func (s sb) Destroy() error   { return nil }
func (s sb) Exited() <-chan struct{} {
	return s.a.exited
}
func (s sb) Cgroup() *cgroups.Cgroup   { return nil }
func (s sb) Network() *network.Sandbox { return nil }
func (s sb) Dial(ctx context.Context) (net.Conn, error) {
	s.a.dials.Add(1)
	var d net.Dialer
	return d.DialContext(ctx, "tcp", s.a.l.Addr().String())
}

type sandboxes struct{ s wall.Sandbox }

func (x sandboxes) Lookup(id string) (Access, bool) {
	if x.s == nil || id != x.s.ID() {
		return Access{}, false
	}
	return Access{Token: x.s.Token(), Traffic: "traffic"}, true
}

func (x sandboxes) Ready(ctx context.Context, id string, _ bool) (wall.Sandbox, error) {
	if x.s == nil || id != x.s.ID() {
		return nil, errors.New("no such sandbox")
	}
	return x.s, nil
}

func gzipBomb(t *testing.T, size int) []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	zeros := make([]byte, 1<<20)
	for i := 0; i < size>>20; i++ {
		_, _ = zw.Write(zeros)
	}
	zw.Close()
	return b.Bytes()
}

// TestEnvdTokenBeforeBody: a request for the agent's port that lacks the
// access token (or a valid /files signature) is answered 401 by the proxy
// and no byte of it reaches the agent; /health alone passes without one.
// Before the fix, the proxy forwarded every port-49983 request and left the
// check to the agent, which read (and decompressed) the body first.
func TestEnvdTokenBeforeBody(t *testing.T) {
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	bomb := gzipBomb(t, 256<<20) // 256 MiB of zeros, a few hundred KiB sent
	sig := filesig.Sign("/tmp/x", "write", "user", "the-token", 0)
	expired := time.Now().Add(-time.Minute).Unix()
	cases := []struct {
		name, method, path, token string
		body                      []byte
		want                      int
		reaches                   bool
	}{
		{"RPC without a token", "POST", "/process.Process/List", "", bomb, 401, false},
		{"RPC with a wrong token", "POST", "/filesystem.Filesystem/Stat", "not-the-token", bomb, 401, false},
		{"upload without a token", "POST", "/files?path=/tmp/x", "", bomb, 401, false},
		{"upload with a signature for another path", "POST", "/files?path=/etc/passwd&username=user&signature=" + url.QueryEscape(sig), "", bomb, 401, false},
		{"upload with an expired signature", "POST", "/files?" + url.Values{"path": {"/tmp/x"}, "username": {"user"},
			"signature_expiration": {strconv.FormatInt(expired, 10)},
			"signature":            {filesig.Sign("/tmp/x", "write", "user", "the-token", expired)}}.Encode(), "", bomb, 401, false},
		{"a read signature used to write", "POST", "/files?" + url.Values{"path": {"/tmp/x"}, "username": {"user"},
			"signature": {filesig.Sign("/tmp/x", "read", "user", "the-token", 0)}}.Encode(), "", []byte("x"), 401, false},
		{"envs without a token", "GET", "/envs", "", nil, 401, false},
		{"health", "GET", "/health", "", nil, 204, true},
		{"RPC with the token", "POST", "/process.Process/List", "the-token", []byte("{}"), 200, true},
		{"upload with a valid signature", "POST", "/files?path=/tmp/x&username=user&signature=" + url.QueryEscape(sig), "", []byte("x"), 200, true},
	}
	for _, c := range cases {
		before := a.requests.Load()
		req, _ := http.NewRequest(c.method, srv.URL+c.path, bytes.NewReader(c.body))
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("Content-Encoding", "gzip")
		if c.token != "" {
			req.Header.Set("X-Access-Token", c.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		resp.Body.Close()
		reached := a.requests.Load() > before
		if resp.StatusCode != c.want || reached != c.reaches {
			t.Errorf("%s: status %d, reached the agent %v; want %d, %v", c.name, resp.StatusCode, reached, c.want, c.reaches)
		}
	}
	if n := a.bodyBytes.Load(); n > 64 {
		t.Errorf("the agent received %d body bytes; only the authorized requests' few should pass", n)
	}
}

// TestPortSweepOnePool: a client that sweeps every port of a sandbox
// through the proxy leaves one connection pool for the sandbox, not one
// per port (65,535 of them before).
func TestPortSweepOnePool(t *testing.T) {
	a := newFakeAgent(t)
	p := New(sandboxes{sb{a}}, "", nil)
	srv := httptest.NewServer(p)
	defer srv.Close()
	var wg sync.WaitGroup
	ports := make(chan int)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for port := range ports {
				req, _ := http.NewRequest("GET", srv.URL+"/", nil)
				req.Header.Set("E2b-Sandbox-Id", "sandbox1")
				req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(port))
				req.Header.Set(TrafficHeader, "traffic")
				if resp, err := http.DefaultClient.Do(req); err == nil {
					resp.Body.Close()
				}
			}
		}()
	}
	for port := 1; port <= 3000; port++ {
		ports <- port
	}
	close(ports)
	wg.Wait()
	p.mu.Lock()
	n := len(p.transports)
	p.mu.Unlock()
	if n != 1 {
		t.Errorf("after a sweep of 3000 ports: %d connection pools, want 1 for the sandbox", n)
	}
}

func TestRoute(t *testing.T) {
	p := New(sandboxes{}, "example.test", nil)
	for _, c := range []struct {
		host, idHdr, portHdr string
		id                   string
		port                 int
		ok                   bool
	}{
		{"8080-abc.example.test", "", "", "abc", 8080, true},
		{"8080-abc.example.test:443", "", "", "abc", 8080, true},
		{"8080-abc.other.test", "", "", "", 0, false},
		{"8080-abc.evil.example.test", "", "", "", 0, false},
		{"abc.example.test", "", "", "", 0, false},
		{"x-abc.example.test", "", "", "", 0, false},
		{"8080-.example.test", "", "", "", 0, false},
		{"whatever", "abc", "", "abc", EnvdPort, true},
		{"whatever", "abc", "3000", "abc", 3000, true},
		{"whatever", "abc", "3k", "abc", 0, false},
		{"whatever", "abc", "0", "abc", 0, false},
		{"whatever", "abc", "65536", "abc", 0, false},
		{"whatever", "abc", "+80", "abc", 0, false},
		{"080-abc.example.test", "", "", "", 0, false},
		{"65535-abc.example.test", "", "", "abc", 65535, true},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = c.host
		if c.idHdr != "" {
			r.Header.Set("E2b-Sandbox-Id", c.idHdr)
		}
		if c.portHdr != "" {
			r.Header.Set("E2b-Sandbox-Port", c.portHdr)
		}
		id, port, ok := p.route(r)
		if ok != c.ok || (ok && (id != c.id || port != c.port)) {
			t.Errorf("route(Host %q, id %q, port %q) = %q %d %v; want %q %d %v", c.host, c.idHdr, c.portHdr, id, port, ok, c.id, c.port, c.ok)
		}
	}
}

// FuzzRoute: whatever the Host and E2B headers, routing never panics, a
// host-routed request names a sandbox only under the proxy's own domain,
// and a sandbox id never carries a dot (it could not name a host then).
func FuzzRoute(f *testing.F) {
	for _, s := range [][3]string{
		{"8080-abc.example.test", "", ""}, {"49983-abc.example.test:3001", "", ""}, {"-1-abc.example.test", "", ""},
		{"8080-abc.example.test.evil", "", ""}, {"[::1]:80", "", ""}, {"x", "abc", "99999999999999999999"},
		{"x", "abc", "-5"}, {"8080-a-b.example.test", "", ""}, {"", "", ""}, {"0x1f-abc.example.test", "", ""},
	} {
		f.Add(s[0], s[1], s[2])
	}
	p := New(sandboxes{}, "example.test", nil)
	f.Fuzz(func(t *testing.T, host, id, port string) {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = host
		r.Header.Set("E2b-Sandbox-Id", id)
		r.Header.Set("E2b-Sandbox-Port", port)
		gotID, gotPort, ok := p.route(r)
		if !ok {
			return
		}
		if id != "" {
			if gotID != id {
				t.Fatalf("header-routed id %q became %q", id, gotID)
			}
			return
		}
		h := host
		if hh, _, err := net.SplitHostPort(host); err == nil {
			h = hh
		}
		if want := strconv.Itoa(gotPort) + "-" + gotID + ".example.test"; h != want {
			t.Fatalf("host %q routed to sandbox %q port %d (that host would be %q)", host, gotID, gotPort, want)
		}
	})
}

// TestEarlyAnswerReachesClient: a sandbox's server that refuses a large
// body before reading it (413) — a client that sends its 10 MB whole
// before it reads, as Node's does, reads the 413 through the proxy rather
// than a connection reset (the code interpreter's 413 to 10 MB of code
// reached the E2B SDK as ECONNRESET: Go's server closed the connection
// with the body unread, and the kernel reset it under the client's feet).
func TestEarlyAnswerReachesClient(t *testing.T) {
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	big := bytes.Repeat([]byte("#"), 10<<20)
	for i := 0; i < 3; i++ {
		c, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		head := "POST /refuse HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: sandbox1\r\nX-Access-Token: the-token\r\n" +
			"Content-Length: " + strconv.Itoa(len(big)) + "\r\n\r\n"
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.Write(append([]byte(head), big...)); err != nil {
			c.Close()
			t.Fatalf("try %d: sending the body: %v (the proxy let the connection go before the client was done)", i, err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			c.Close()
			t.Fatalf("try %d: reading the answer: %v", i, err)
		}
		resp.Body.Close()
		c.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("try %d: %d, want 413", i, resp.StatusCode)
		}
	}
}

func (a *fakeAgent) letGo() {
	select {
	case <-a.release:
	default:
		close(a.release)
	}
}

// TestSandboxAnswerHeadBounded: a sandbox's server answering with a head of
// 1 MiB gets its client a 502; the proxy reads no more than 64 KiB of it
// (net/http's default, 10 MiB, held per request while a client does not
// read: 559 MiB for 60 requests in a review's run).
func TestSandboxAnswerHeadBounded(t *testing.T) {
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/bighead", nil)
	req.Header.Set("E2b-Sandbox-Id", "sandbox1")
	req.Header.Set("X-Access-Token", "the-token")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway || resp.Header.Get("X-Big-0") != "" {
		t.Errorf("a 1 MiB head from the sandbox: %d, want 502", resp.StatusCode)
	}
}

// TestInFlightPerSandbox: the proxy relays at most maxInFlightPerSandbox
// requests to one sandbox at once; the next gets 429 (before, none: one
// HTTP/2 client connection made the proxy open 240 connections to the
// sandbox); once they end, requests go through again.
func TestInFlightPerSandbox(t *testing.T) {
	defer func(n int) { maxInFlightPerSandbox = n }(maxInFlightPerSandbox)
	maxInFlightPerSandbox = 128 // some 4 descriptors each in this process
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: maxInFlightPerSandbox + 8}}
	defer c.CloseIdleConnections()
	get := func(path string) (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("X-Access-Token", "the-token")
		return c.Do(req)
	}
	held := make(chan *http.Response, maxInFlightPerSandbox)
	errs := make(chan error, maxInFlightPerSandbox)
	for range maxInFlightPerSandbox {
		go func() {
			resp, err := get("/hold")
			if err != nil {
				errs <- err
				return
			}
			held <- resp
		}()
	}
	var open []*http.Response
	for range maxInFlightPerSandbox {
		select {
		case resp := <-held:
			open = append(open, resp)
		case err := <-errs:
			t.Fatalf("a held request: %v", err)
		case <-time.After(60 * time.Second):
			t.Fatalf("%d of %d held requests answered", len(open), maxInFlightPerSandbox)
		}
	}
	for _, resp := range open {
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("a held request: %d", resp.StatusCode)
		}
	}
	resp, err := get("/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Errorf("one request beyond %d at once: %d, want 429", maxInFlightPerSandbox, resp.StatusCode)
	}
	a.letGo()
	for _, resp := range open {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		resp, err := get("/health")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusNoContent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the held requests ended: %d, want 204", resp.StatusCode)
		}
	}
}

// twoSandboxes holds a public sandbox ("pub") and one whose ports need
// its traffic token ("priv"), each a server of its own that names itself.
type twoSandboxes map[string]wall.Sandbox

func (x twoSandboxes) Lookup(id string) (Access, bool) {
	if _, ok := x[id]; !ok {
		return Access{}, false
	}
	return Access{Token: "the-token", Traffic: "traffic-" + id, Public: id == "pub"}, true
}

func (x twoSandboxes) Ready(_ context.Context, id string, _ bool) (wall.Sandbox, error) {
	if s, ok := x[id]; ok {
		return s, nil
	}
	return nil, errors.New("no such sandbox")
}

// TestHostTricksReachNoOtherSandbox: whatever a client does with the
// names a request carries (an absolute URI beside its Host, two Hosts,
// another case, a trailing dot, X-Forwarded-Host, the routing headers
// beside a Host), or with the connection it sends them on (a request for
// another sandbox after one for a public sandbox, on the same keep-alive
// connection, with or after an upgrade asked for), a request reaches the
// sandbox it is checked for and no other: the one whose ports need the
// traffic token is never reached without it.
func TestHostTricksReachNoOtherSandbox(t *testing.T) {
	a := newFakeAgent(t)
	x := twoSandboxes{}
	for _, id := range []string{"pub", "priv"} {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "sandbox "+id)
		}))
		t.Cleanup(s.Close)
		x[id] = portSandbox{sb{a}, s.Listener.Addr().String()}
	}
	srv := httptest.NewServer(New(x, "example.test", nil))
	defer srv.Close()
	const pub, priv = "Host: 8080-pub.example.test\r\n", "Host: 8080-priv.example.test\r\n"
	for _, c := range []struct {
		name, raw string
		want      []string // each answer's status and body's start
	}{
		{"keep-alive to another sandbox", "GET / HTTP/1.1\r\n" + pub + "\r\nGET / HTTP/1.1\r\n" + priv + "\r\n",
			[]string{"200 sandbox pub", "403 {"}},
		{"upgrade asked, then another sandbox", "GET / HTTP/1.1\r\n" + pub + "Connection: Upgrade\r\nUpgrade: websocket\r\n\r\nGET / HTTP/1.1\r\n" + priv + "\r\n",
			[]string{"200 sandbox pub", "403 {"}},
		{"absolute URI beside Host", "GET http://8080-priv.example.test/ HTTP/1.1\r\n" + pub + "\r\n", []string{"403 {"}},
		{"absolute URI wins", "GET http://8080-pub.example.test/ HTTP/1.1\r\n" + priv + "\r\n", []string{"200 sandbox pub"}},
		{"two Hosts", "GET / HTTP/1.1\r\n" + pub + priv + "\r\n", []string{"400 "}},
		{"another case", "GET / HTTP/1.1\r\nHost: 8080-PRIV.example.test\r\n\r\n", []string{"502 {"}},
		{"trailing dot", "GET / HTTP/1.1\r\nHost: 8080-priv.example.test.\r\n\r\n", []string{"400 {"}},
		{"X-Forwarded-Host", "GET / HTTP/1.1\r\n" + pub + "X-Forwarded-Host: 8080-priv.example.test\r\n\r\n", []string{"200 sandbox pub"}},
		{"routing headers beside a Host", "GET / HTTP/1.1\r\n" + pub + "E2b-Sandbox-Id: priv\r\nE2b-Sandbox-Port: 8080\r\n\r\n", []string{"403 {"}},
		{"with its token", "GET / HTTP/1.1\r\n" + priv + TrafficHeader + ": traffic-priv\r\n\r\n", []string{"200 sandbox priv"}},
		{"another's token", "GET / HTTP/1.1\r\n" + priv + TrafficHeader + ": traffic-pub\r\n\r\n", []string{"403 {"}},
	} {
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(conn, c.raw); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(conn)
		var got []string
		for range c.want {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				got = append(got, err.Error())
				break
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			got = append(got, strconv.Itoa(resp.StatusCode)+" "+string(b))
		}
		conn.Close()
		for i, w := range c.want {
			if i >= len(got) || !strings.HasPrefix(got[i], w) {
				t.Errorf("%s: answers %q, want %q", c.name, got, c.want)
				break
			}
		}
	}
}

// noTokens is a sandbox whose record holds no tokens (none is made so; a
// store written by another version could hold one).
type noTokens struct{ sandbox wall.Sandbox }

func (x noTokens) Lookup(id string) (Access, bool) { return Access{}, id == "bare" }

func (x noTokens) Ready(context.Context, string, bool) (wall.Sandbox, error) {
	return x.sandbox, nil
}

// TestEmptyTokensOpenNothing: a sandbox whose record has no traffic or
// access token is not reached through an empty header, nor a /files URL
// signed with an empty key (an empty token matched an empty header, and
// anyone could sign with it).
func TestEmptyTokensOpenNothing(t *testing.T) {
	a := newFakeAgent(t)
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "reached")
	}))
	defer s.Close()
	srv := httptest.NewServer(New(noTokens{portSandbox{sb{a}, s.Listener.Addr().String()}}, "example.test", nil))
	defer srv.Close()
	exp := time.Now().Add(time.Hour).Unix()
	signed := url.Values{"path": {"/etc/passwd"}, "username": {"user"}, "signature_expiration": {strconv.FormatInt(exp, 10)},
		"signature": {filesig.Sign("/etc/passwd", filesig.Op(http.MethodGet), "user", "", exp)}}
	for _, c := range []struct {
		name, host, path string
		hdr              map[string]string
	}{
		{"a port, an empty traffic token", "8080-bare.example.test", "/", map[string]string{TrafficHeader: ""}},
		{"a port, no traffic token", "8080-bare.example.test", "/", nil},
		{"envd, an empty access token", "49983-bare.example.test", "/process.Process/List", map[string]string{"X-Access-Token": ""}},
		{"envd, a /files URL signed with an empty key", "49983-bare.example.test", "/files?" + signed.Encode(), nil},
		{"the interpreter, an empty access token", "49999-bare.example.test", "/execute", map[string]string{"X-Access-Token": ""}},
	} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+c.path, nil)
		req.Host = c.host
		for k, v := range c.hdr {
			req.Header[k] = []string{v}
		}
		res, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
		if err != nil {
			t.Errorf("%s: %v (let through to the sandbox, which did not answer), want 401 or 403", c.name, err)
			continue
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusForbidden && res.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s: %d %q, want 401 or 403", c.name, res.StatusCode, body)
		}
	}
}
