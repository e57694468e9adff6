package proxy

import (
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// Attack: the server on a sandbox's port (its own code, or the code
// interpreter it replaced) answers with a status that is three digits but
// no HTTP status net/http may write (000, 042, 099), which Go's client
// takes. Expected: the client gets the proxy's 502, a one-line JSON that
// says the sandbox's answer was not HTTP; the proxy's handler does not
// panic (before, net/http's WriteHeader panicked: the client's connection
// was cut, and each request wrote a goroutine's stack to the daemon's
// log).
func TestSandboxStatusOutOfRange(t *testing.T) {
	a := newFakeAgent(t)
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect {
			w.WriteHeader(http.StatusOK)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 " + r.URL.Query().Get("status") + " Odd\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
		_ = brw.Flush()
	})
	var logged testutil.SyncBuffer
	srv := httptest.NewUnstartedServer(New(sandboxes{sb{a}}, "", nil))
	srv.Config.ErrorLog = log.New(&logged, "", 0)
	srv.Start()
	defer srv.Close()
	for _, status := range []string{"000", "042", "099"} {
		for _, port := range []int{InterpPort, 6080} {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/execute?status="+status, strings.NewReader(`{"code":"1"}`))
			req.Header.Set("E2b-Sandbox-Id", "sandbox1")
			req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(port))
			req.Header.Set(TrafficHeader, "traffic")
			req.Header.Set("X-Access-Token", "the-token")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Errorf("status %s on port %d: %v, want the proxy's 502", status, port, err)
				continue
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), `"code":502`) {
				t.Errorf("status %s on port %d: %d %q, want the proxy's 502", status, port, resp.StatusCode, body)
			}
		}
	}
	if s := logged.String(); strings.Contains(s, "panic") {
		t.Errorf("the proxy panicked: %.400s", s)
	}
}

// Attack: the server on a sandbox's public port (any tenant's own code)
// answers each request with a body shorter than its Content-Length, and
// the tenant, or anyone, sends it requests as fast as it likes. Expected:
// the daemon's log takes at most a line a second of it, through the
// proxy's logger, with how many went unlogged (found by review,
// 2026-12-04: net/http's reverse proxy wrote a line to the standard
// logger for each such answer, so a tenant filled the host's log, and
// took the journal's rate limit that the daemon's own lines share, at
// its request rate).
func TestSandboxCutAnswersLogBounded(t *testing.T) {
	a := newFakeAgent(t)
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect {
			w.WriteHeader(http.StatusOK)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nx")
		_ = brw.Flush()
	})
	var std, own testutil.SyncBuffer
	log.SetOutput(&std)
	defer log.SetOutput(os.Stderr)
	srv := httptest.NewServer(New(public{sandboxes{sb{a}}}, "", slog.New(slog.NewTextHandler(&own, nil))))
	defer srv.Close()
	const n = 40
	for range n {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("E2b-Sandbox-Port", "8080")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if s := std.String(); s != "" {
		t.Errorf("%d lines to the standard logger for %d cut answers: %.300s", strings.Count(s, "\n"), n, s)
	}
	if lines := strings.Count(own.String(), "\n"); lines > 3 {
		t.Errorf("%d lines in the daemon's log for %d cut answers in a moment: %.300s", lines, n, own.String())
	}
}
