package proxy

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

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
