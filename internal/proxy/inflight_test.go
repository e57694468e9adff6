package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/filesig"
	"github.com/cagehq/cage/internal/wall"
)

// public is sandboxes whose ports are public (E2B's default).
type public struct{ sandboxes }

func (x public) Lookup(id string) (Access, bool) {
	a, ok := x.sandboxes.Lookup(id)
	a.Public = true
	return a, ok
}

func (x public) Ready(ctx context.Context, id string, resume bool) (wall.Sandbox, error) {
	return x.sandboxes.Ready(ctx, id, resume)
}

// TestAnonymousNeverFillsOwnersBudget: requests without the sandbox's
// credential (anyone's, to its open /health or its public ports), as many
// as its budget holds, leave the owner's requests their own budget; and a
// request the sandbox refused no longer counts while the proxy reads
// what is left of its body.
func TestAnonymousNeverFillsOwnersBudget(t *testing.T) {
	defer func(n int) { maxInFlightPerSandbox = n }(maxInFlightPerSandbox)
	maxInFlightPerSandbox = 64
	a := newFakeAgent(t)
	a.holdOpen.Store(true)
	srv := httptest.NewServer(New(public{sandboxes{sb{a}}}, "", nil))
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * maxInFlightPerSandbox}}
	defer c.CloseIdleConnections()
	do := func(method, path, token string) int {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// Anyone fills the sandbox's anonymous budget with open /health
	// requests its agent holds.
	held := make(chan *http.Response, maxInFlightPerSandbox)
	for range maxInFlightPerSandbox {
		go func() {
			req, _ := http.NewRequest(http.MethodGet, srv.URL+"/health", nil)
			req.Header.Set("E2b-Sandbox-Id", "sandbox1")
			resp, err := c.Do(req)
			if err != nil {
				t.Error(err)
				held <- nil
				return
			}
			held <- resp
		}()
	}
	for range maxInFlightPerSandbox {
		if resp := <-held; resp != nil {
			defer resp.Body.Close()
		}
	}
	if got := do(http.MethodGet, "/health", ""); got != http.StatusTooManyRequests {
		t.Errorf("an anonymous request beyond the budget: %d, want 429", got)
	}
	if got := do(http.MethodPost, "/filesystem.Filesystem/Stat", "the-token"); got != http.StatusOK {
		t.Errorf("the owner's request while anonymous ones fill their budget: %d, want 200", got)
	}
	a.letGo()

	// Requests to a closed public port that announce a body they never
	// send: each gets its 502, then the proxy reads what is left of its
	// body for a while; meanwhile it counts against no budget.
	addr := strings.TrimPrefix(srv.URL, "http://")
	for i := range maxInFlightPerSandbox {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: proxy\r\nE2b-Sandbox-Id: sandbox1\r\nE2b-Sandbox-Port: 1\r\nContent-Length: 1000000\r\n\r\nx")
		if i == 0 {
			line := make([]byte, 12)
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := conn.Read(line); err != nil || string(line) != "HTTP/1.1 502" {
				t.Fatalf("a request to a closed port: %q %v", line, err)
			}
		}
	}
	time.Sleep(500 * time.Millisecond) // the rest reach their answers too (a 429 would make the check below pass)
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
	req.Header.Set("E2b-Sandbox-Id", "sandbox1")
	req.Header.Set("E2b-Sandbox-Port", "1")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("an anonymous request while %d refused ones are drained: %d, want 502", maxInFlightPerSandbox, resp.StatusCode)
	}
}

// TestOpenHealthCarriesNoBody: what a client sends with the open /health
// (no credential) never reaches the agent.
func TestOpenHealthCarriesNoBody(t *testing.T) {
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/health", strings.NewReader(strings.Repeat("x", 1<<20)))
	req.Header.Set("E2b-Sandbox-Id", "sandbox1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("/health: %d", resp.StatusCode)
	}
	if n, m := a.bodyBytes.Load(), a.bodyHeads.Load(); n != 0 || m != 0 {
		t.Errorf("the agent got %d bytes of body (%d requests with one) from a client without a token", n, m)
	}
}

// keyedSandboxes are sandboxes of one fake agent under several ids, each
// of an API key (owners: id -> key), their ports public.
type keyedSandboxes struct {
	a      *fakeAgent
	owners map[string]string
}

// named is the fake agent's sandbox under another id.
type named struct {
	sb
	id string
}

func (n named) ID() string { return n.id }

func (x keyedSandboxes) Lookup(id string) (Access, bool) {
	key, ok := x.owners[id]
	return Access{Token: "the-token", Traffic: "traffic", Public: true, Owner: key}, ok
}

func (x keyedSandboxes) Ready(_ context.Context, id string, _ bool) (wall.Sandbox, error) {
	if _, ok := x.owners[id]; !ok {
		return nil, errors.New("no such sandbox")
	}
	return named{sb{x.a}, id}, nil
}

// TestInFlightPerKeyAndClient: a key's credentialed requests to all its
// sandboxes together, and a client's anonymous ones to all sandboxes
// together, are bounded, and the bound of one key or client leaves
// another's requests alone. Before (found by review, 2026-12-04): only
// each sandbox's were, so a key held 1,024 requests for each of its
// sandboxes (some 48 MiB of the daemon each, measured through the real
// daemon: 1,000 Connect streams took it from 34 to 81 MiB) and an
// anonymous client 128 for each public sandbox whose server holds them.
func TestInFlightPerKeyAndClient(t *testing.T) {
	defer func(a, b, c, d int) {
		maxInFlightPerSandbox, maxAnonymousPerClient, maxInFlightPerKey, maxAnonymousPerClientAll = a, b, c, d
	}(maxInFlightPerSandbox, maxAnonymousPerClient, maxInFlightPerKey, maxAnonymousPerClientAll)
	maxInFlightPerSandbox, maxAnonymousPerClient, maxInFlightPerKey, maxAnonymousPerClientAll = 3, 3, 4, 4
	a := newFakeAgent(t)
	a.holdOpen.Store(true)
	p := New(keyedSandboxes{a, map[string]string{"sbA1": "keyA", "sbA2": "keyA", "sbB": "keyB"}}, "", nil)
	p.Client = func(r *http.Request) string { return r.Header.Get("X-Test-Client") }
	srv := httptest.NewServer(p)
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer c.CloseIdleConnections()
	var held []*http.Response
	defer func() {
		a.letGo()
		for _, r := range held {
			r.Body.Close()
		}
	}()
	// do sends a request that the agent holds (once answered 200, it
	// stays in flight) and returns its status.
	do := func(id, path, token, client string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		req.Header.Set("E2b-Sandbox-Id", id)
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		req.Header.Set("X-Test-Client", client)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode == http.StatusOK {
			held = append(held, resp)
		} else {
			resp.Body.Close()
		}
		return resp.StatusCode
	}
	// keyA: three requests to one sandbox (its own bound), one to its
	// other; a fifth to either is over the key's bound.
	for range 3 {
		if got := do("sbA1", "/hold", "the-token", ""); got != http.StatusOK {
			t.Fatalf("keyA's request to sbA1: %d", got)
		}
	}
	if got := do("sbA2", "/hold", "the-token", ""); got != http.StatusOK {
		t.Fatalf("keyA's request to sbA2: %d", got)
	}
	if got := do("sbA2", "/hold", "the-token", ""); got != http.StatusTooManyRequests {
		t.Errorf("keyA's fifth request (its bound 4): %d, want 429", got)
	}
	if got := do("sbB", "/hold", "the-token", ""); got != http.StatusOK {
		t.Errorf("keyB's request while keyA is at its bound: %d, want 200", got)
	}
	// One anonymous client: three to one sandbox, one to another, the
	// fifth refused; another client is let in.
	for range 3 {
		if got := do("sbA1", "/health", "", "c1"); got != http.StatusOK {
			t.Fatalf("c1's anonymous request to sbA1: %d", got)
		}
	}
	if got := do("sbB", "/health", "", "c1"); got != http.StatusOK {
		t.Fatalf("c1's anonymous request to sbB: %d", got)
	}
	if got := do("sbA2", "/health", "", "c1"); got != http.StatusTooManyRequests {
		t.Errorf("c1's fifth anonymous request (its bound 4): %d, want 429", got)
	}
	if got := do("sbA2", "/health", "", "c2"); got != http.StatusOK {
		t.Errorf("c2's anonymous request while c1 is at its bound: %d, want 200", got)
	}
	// All let go: nothing left counted.
	a.letGo()
	for _, r := range held {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	held = nil
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		p.mu.Lock()
		n := len(p.byKey) + len(p.byClient) + len(p.inFlight) + len(p.anonymous)
		p.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d counts left after every request ended", n)
		}
	}
}

// TestSignedFilesURLIsNotTheOwners: a signed /files URL is E2B's way to
// let a browser move one file, so whoever has the link may use it; it is
// not the owner's access token. Attack: from one address, the link's
// holder opens more uploads than the sandbox's budget holds, each
// announcing a body and sending a byte of it. Expected: they take at most
// that address's share of the anonymous budget (429 beyond), the owner's
// requests with the access token are served meanwhile, and a stalled one
// is ended after the idle time as anyone's is. Found by review,
// 2026-12-04: they counted as the owner's, without a share per address or
// an idle time, so one link's holder took the sandbox's whole
// credentialed budget for good and the owner's commands got 429.
func TestSignedFilesURLIsNotTheOwners(t *testing.T) {
	defer func(a, b int, d time.Duration) {
		maxInFlightPerSandbox, maxAnonymousPerClient, relayIdle = a, b, d
	}(maxInFlightPerSandbox, maxAnonymousPerClient, relayIdle)
	maxInFlightPerSandbox, maxAnonymousPerClient, relayIdle = 8, 2, 3*time.Second
	a := newFakeAgent(t)
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	q := url.Values{"path": {"/tmp/x"}, "username": {"user"}, "signature": {filesig.Sign("/tmp/x", "write", "user", "the-token", 0)}}
	statuses := make(chan string, maxInFlightPerSandbox)
	for range maxInFlightPerSandbox {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST /files?%s HTTP/1.1\r\nHost: proxy\r\nE2b-Sandbox-Id: sandbox1\r\n"+
			"Content-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\nx", q.Encode())
		go func() {
			line, _ := bufio.NewReader(conn).ReadString('\n')
			statuses <- strings.TrimSpace(line)
		}()
	}
	refused := 0
	for deadline := time.After(2 * time.Second); refused < maxInFlightPerSandbox-maxAnonymousPerClient; {
		select {
		case s := <-statuses:
			if !strings.HasPrefix(s, "HTTP/1.1 429") {
				t.Fatalf("a signed upload beyond the address's share: %q, want 429", s)
			}
			refused++
		case <-deadline:
			t.Fatalf("%d of %d held signed uploads from one address were let in (its share: %d)",
				maxInFlightPerSandbox-refused, maxInFlightPerSandbox, maxAnonymousPerClient)
		}
	}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/filesystem.Filesystem/Stat", nil)
	req.Header.Set("E2b-Sandbox-Id", "sandbox1")
	req.Header.Set("X-Access-Token", "the-token")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the owner's request while a link's holder stalls uploads: %d, want 200", resp.StatusCode)
	}
	for range maxAnonymousPerClient {
		select {
		case s := <-statuses:
			if !strings.HasPrefix(s, "HTTP/1.1 504") {
				t.Errorf("a stalled signed upload: %q, want 504 after the idle time", s)
			}
		case <-time.After(4 * relayIdle):
			t.Fatalf("a stalled signed upload is still open after %v (idle time %v)", 4*relayIdle, relayIdle)
		}
	}
}

// TestOpenHealthUpgradesNothing: anyone's open GET /health asks the agent
// to switch protocols (Connection: Upgrade), and the agent, assumed
// compromised, agrees (101). Expected: the proxy relays no switch (its
// 502), so no byte the client sends after its request reaches the agent:
// the open /health carries nothing to the agent but its request line and
// headers, whatever the agent answers. Found by review, 2026-12-04: the
// upgrade was relayed, a tunnel without the access token into a sandbox
// whose ports need its traffic token.
func TestOpenHealthUpgradesNothing(t *testing.T) {
	a := newFakeAgent(t)
	var got atomic.Int64
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "Upgrade")
		w.Header().Set("Upgrade", "websocket")
		w.WriteHeader(http.StatusSwitchingProtocols)
		c, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		n, _ := io.Copy(io.Discard, c)
		got.Add(n)
	})
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /health HTTP/1.1\r\nHost: proxy\r\nE2b-Sandbox-Id: sandbox1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, _ := bufio.NewReader(conn).ReadString('\n')
	_, _ = io.WriteString(conn, strings.Repeat("x", 1<<16))
	time.Sleep(2500 * time.Millisecond)
	if strings.HasPrefix(line, "HTTP/1.1 101") || got.Load() != 0 {
		t.Errorf("anyone's open /health: %q, and %d bytes after it reached the agent; want no switch, none", strings.TrimSpace(line), got.Load())
	}
}
