package abuse

import (
	"bufio"
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
	out := execAnswer(t, resp)
	if out.IsError || out.ExitCode != 0 || out.Stdout != "through-the-proxy\n" {
		t.Errorf("/mcp exec with the loopback address's proxy connections full: %+v; want its output", out)
	}
}

// mcpExec is what an answer of /mcp's exec tool says.
type mcpExec struct {
	IsError  bool
	ExitCode int32
	Stdout   string
	Content  []string // the text parts (an error's words)
}

// execAnswer reads an answer of /mcp's exec tool (JSON, or an event
// stream's data line).
func execAnswer(t *testing.T, resp *http.Response) mcpExec {
	t.Helper()
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
			} `json:"structuredContent"`
			Content []struct {
				Text string `json:"text"`
			} `json:"content"`
		} `json:"result"`
	}
	if err := json.NewDecoder(strings.NewReader(text)).Decode(&out); err != nil {
		t.Fatalf("/mcp exec answer %q: %v", body, err)
	}
	r := mcpExec{IsError: out.Result.IsError, ExitCode: out.Result.StructuredContent.ExitCode, Stdout: out.Result.StructuredContent.Stdout}
	for _, c := range out.Result.Content {
		r.Content = append(r.Content, c.Text)
	}
	return r
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// TestMCPsOwnAPIConnections: /mcp's tools call the API from the daemon
// itself, on the loopback address, for every tenant alike. Attack: local
// users (or many keys' tool calls at once) fill the loopback address's
// conns_per_client on the API listener. Expected: /mcp's exec, sent on one
// of the held connections, still runs its command (the tools' API calls
// are the daemon's own, held to the bound on all connections only), while
// another plain connection from loopback is refused. Before, the tool's
// own API call was refused, and the tool failed.
func TestMCPsOwnAPIConnections(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(cfg, []byte(`{"limits": {"conns_per_client": 16}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := cageserve.Start(t, "--config", cfg)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600})
	if host, _, err := net.SplitHostPort(d.API); err != nil || host != "127.0.0.1" {
		t.Fatalf("API at %s: this test needs it on 127.0.0.1", d.API)
	}
	d.HTTP.CloseIdleConnections()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	// 16 held, each alive (a refused one is closed at once: the test
	// client's idle ones may still count for a moment after it closed
	// them); then a 17th is refused.
	alive := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		_, err := c.Read(make([]byte, 1))
		_ = c.SetReadDeadline(time.Time{})
		return isTimeout(err)
	}
	for deadline := time.Now().Add(10 * time.Second); len(held) < 16; {
		c, err := net.DialTimeout("tcp", d.API, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if alive(c) {
			held = append(held, c)
			continue
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatalf("only %d connections from loopback held (conns_per_client 16)", len(held))
		}
		time.Sleep(100 * time.Millisecond)
	}
	extra, err := net.DialTimeout("tcp", d.API, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	if alive(extra) {
		t.Fatal("a 17th plain connection from loopback (conns_per_client 16) was not closed")
	}
	call := `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"exec","arguments":{"sandbox_id":"` +
		sb.SandboxID + `","command":"echo through-the-api"}}}`
	req, _ := http.NewRequest(http.MethodPost, "http://"+d.API+"/mcp", strings.NewReader(call))
	req.Header.Set("Authorization", "Bearer "+d.Key)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	conn := held[0]
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatalf("/mcp on a held connection: %v", err)
	}
	out := execAnswer(t, resp)
	if out.IsError || out.ExitCode != 0 || out.Stdout != "through-the-api\n" {
		t.Errorf("/mcp exec with the loopback address's API connections full: %+v; want its output", out)
	}
}
