package abuse

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestDaemonsOwnProxyConnections: the dashboard's terminals and files and
// /mcp's tools reach agents through the proxy from the daemon itself, on
// the loopback address, every tenant's alike. Attack: local users (or a
// few keys' dashboard sessions held open) fill the loopback address's
// conns_per_client on the proxy. Expected: /mcp's exec still runs its
// command (the daemon's own connections are held to the bound on all
// connections only), while another plain connection from loopback is
// refused. Found by review, 2026-12-04.
func TestDaemonsOwnProxyConnections(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(cfg, []byte(`{"limits": {"conns_per_client": 16}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := cageserve.Start(t, "--config", cfg)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600})
	host, _, err := net.SplitHostPort(d.Proxy)
	if err != nil || host != "127.0.0.1" {
		t.Fatalf("proxy at %s: this test needs it on 127.0.0.1", d.Proxy)
	}
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for len(held) < 16 {
		c, err := net.DialTimeout("tcp", d.Proxy, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	// The bound is full: one more plain connection is closed at once.
	extra, err := net.DialTimeout("tcp", d.Proxy, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, err := extra.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("a 17th plain connection from loopback (conns_per_client 16) was not closed: %v", err)
	}
	call := `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"exec","arguments":{"sandbox_id":"` +
		sb.SandboxID + `","command":"echo through-the-proxy"}}}`
	req, _ := http.NewRequest(http.MethodPost, "http://"+d.API+"/mcp", strings.NewReader(call))
	req.Header.Set("Authorization", "Bearer "+d.Key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	resp, err := d.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/mcp exec: %d %s", resp.StatusCode, body)
	}
	text := string(body)
	if i := strings.Index(text, "{"); i > 0 { // an event stream's data line
		text = text[i:]
	}
	var out struct {
		Result struct {
			IsError           bool `json:"isError"`
			StructuredContent struct {
				ExitCode int32  `json:"exit_code"`
				Stdout   string `json:"stdout"`
				Error    string `json:"error"`
			} `json:"structuredContent"`
		} `json:"result"`
	}
	if err := json.NewDecoder(strings.NewReader(text)).Decode(&out); err != nil {
		t.Fatalf("/mcp exec answer %q: %v", body, err)
	}
	sc := out.Result.StructuredContent
	if out.Result.IsError || sc.ExitCode != 0 || sc.Stdout != "through-the-proxy\n" {
		t.Errorf("/mcp exec with the loopback address's proxy connections full: %+v (error %v); want its output", sc, out.Result.IsError)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
