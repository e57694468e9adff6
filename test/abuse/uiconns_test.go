package abuse

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestUIAgentConnsNotTheLoopbacks: the dashboard's terminals reach the
// agent through the proxy from the daemon itself, on the loopback
// address; those connections are the daemon's own, held to the bound on
// all connections, not to the loopback address's conns_per_client. Found
// by review, 2026-12-04: they counted as one local client's, so one
// team's sessions holding their terminals open (a key's 64 sessions, 16
// each) filled it, and every other tenant's terminals, files and /mcp
// tools, and the host's own clients of the proxy, were refused. Here the
// cap is 4: one key's 6 terminals, another key's, and a local client of
// the proxy all get in.
func TestUIAgentConnsNotTheLoopbacks(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(cfg, []byte(`{"limits": {"conns_per_client": 4}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := cageserve.Start(t, "--config", cfg)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600})
	otherKey := d.NewKey(t, "other")
	other := d.Create(t, otherKey, map[string]any{"timeout": 600})
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	src := 10
	open := func(cookie, id string) error {
		src++ // each stream from an address of its own: the test's own connections are not the point
		dl := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(src))}, Timeout: 10 * time.Second}
		c, err := dl.Dial("tcp", d.API)
		if err != nil {
			return err
		}
		conns = append(conns, c)
		fmt.Fprintf(c, "GET /ui/term/%s HTTP/1.1\r\nHost: %s\r\nCookie: %s\r\n\r\n", id, d.API, cookie)
		br := bufio.NewReader(c)
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return fmt.Errorf("terminal stream: %v", err)
			}
			if strings.HasPrefix(line, "event: start") {
				return nil
			}
			if strings.HasPrefix(line, "event: error") || strings.HasPrefix(line, "HTTP/1.1 5") {
				rest, _ := br.ReadString('\n')
				return fmt.Errorf("terminal refused: %s %s", strings.TrimSpace(line), strings.TrimSpace(rest))
			}
		}
	}
	n := 0
	for range 2 {
		cookie, _ := uiSignIn(t, d, d.Key)
		for range 3 {
			n++
			if err := open(cookie, sb.SandboxID); err != nil {
				t.Fatalf("the key's terminal %d (the loopback address's cap is 4): %v", n, err)
			}
		}
	}
	cookie, _ := uiSignIn(t, d, otherKey)
	if err := open(cookie, other.SandboxID); err != nil {
		t.Fatalf("another key's terminal beside the first key's %d: %v", n, err)
	}
	c, err := net.Dial("tcp", d.Proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); err == nil || !isTimeout(err) {
		t.Errorf("a local client's connection to the proxy beside %d terminals was closed: %v", n+1, err)
	}
}
