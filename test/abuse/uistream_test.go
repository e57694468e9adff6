package abuse

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// uiSignIn signs into the dashboard with key and returns its cookie and
// CSRF token.
func uiSignIn(t *testing.T, d *cageserve.Daemon, key string) (cookie, csrf string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, "http://"+d.API+"/ui/session", strings.NewReader(`{"key":"`+key+`"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Origin", "http://"+d.API)
	resp, err := d.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sj struct{ CSRF string }
	if err := json.NewDecoder(resp.Body).Decode(&sj); err != nil || resp.StatusCode != 200 || len(resp.Cookies()) != 1 {
		t.Fatalf("sign in: %d %v", resp.StatusCode, err)
	}
	c := resp.Cookies()[0]
	return c.Name + "=" + c.Value, sj.CSRF
}

// openTerm opens a dashboard terminal on a raw connection, reads up to its
// start event and returns the connection (unread from then on) and the
// terminal's id.
func openTerm(t *testing.T, d *cageserve.Daemon, cookie, id string) (net.Conn, string) {
	t.Helper()
	c, err := net.Dial("tcp", d.API)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	fmt.Fprintf(c, "GET /ui/term/%s?cols=200&rows=50 HTTP/1.1\r\nHost: %s\r\nCookie: %s\r\n\r\n", id, d.API, cookie)
	br := bufio.NewReaderSize(c, 512)
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("terminal stream: %v", err)
		}
		if rest, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(rest, `"term"`) {
			var st struct{ Term string }
			if err := json.Unmarshal([]byte(rest), &st); err != nil {
				t.Fatal(err)
			}
			return c, st.Term
		}
	}
}

// TestUITerminalUnreadBounded: a tenant's dashboard terminals whose
// browser reads nothing while the shell writes as fast as it can hold
// little of the daemon's memory each. Before (found by review,
// 2026-12-04): the daemon's client of the agent, through its proxy,
// granted net/http's 4 MiB a stream, so each such terminal held some
// 4 MiB of heap (16 took the daemon from 33 to 153 MiB in 25 s, still
// rising), and a key's 64 sessions of 8 terminals some 4 GiB.
func TestUITerminalUnreadBounded(t *testing.T) {
	d := cageserve.Start(t)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600})
	rss0, _, _ := cageserve.Memory(d.PID())
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	n := 0
	for range 2 {
		cookie, csrf := uiSignIn(t, d, d.Key)
		for range 8 {
			c, term := openTerm(t, d, cookie, sb.SandboxID)
			conns = append(conns, c)
			req, _ := http.NewRequest(http.MethodPost, "http://"+d.API+"/ui/term/"+sb.SandboxID+"/"+term+"/input",
				strings.NewReader("yes "+strings.Repeat("x", 200)+"\n"))
			req.Header.Set("Cookie", cookie)
			req.Header.Set("X-CSRF-Token", csrf)
			resp, err := d.HTTP.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusNoContent {
				t.Fatalf("terminal input: %d", resp.StatusCode)
			}
			n++
		}
	}
	var peak int64
	for range 20 {
		time.Sleep(time.Second)
		if rss, _, _ := cageserve.Memory(d.PID()); rss > peak {
			peak = rss
		}
	}
	t.Logf("%d terminals unread for 20 s: daemon RSS %d MiB before, peak %d MiB", n, rss0>>20, peak>>20)
	if grew := peak - rss0; grew > int64(n)*3<<20 {
		t.Errorf("the daemon grew %d MiB for %d unread terminals; want at most 3 MiB each", grew>>20, n)
	}
	// The daemon still serves the key.
	if status, _, err := d.Do(http.MethodGet, "/v2/sandboxes", d.Key, nil); err != nil || status != http.StatusOK {
		t.Errorf("list after: %d %v", status, err)
	}
}
