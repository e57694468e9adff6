package daemon

import (
	"crypto/tls"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// TestListenerErrorsLogBounded: anyone who reaches the proxy's TLS
// listener opens connections and fails their handshakes (closes at once,
// names a server it does not serve, sends plain HTTP), as fast as it
// likes. Expected: net/http's line for each goes to the daemon's log at
// most once a second, with how many were left out, never to the standard
// logger. Found by review, 2026-12-04: the listeners had no ErrorLog, so
// each failed handshake was a line of the standard logger, with the server
// name the client chose: anyone filled the host's log, and took the
// journal's rate limit that the daemon's own lines share, at its
// connection rate.
func TestListenerErrorsLogBounded(t *testing.T) {
	var std, own testutil.SyncBuffer
	log.SetOutput(&std)
	defer log.SetOutput(os.Stderr)
	logger := slog.New(slog.NewTextHandler(&own, nil))
	srv := newServer(http.NotFoundHandler(), false, logger)
	cfg := Config{Data: t.TempDir(), Domain: "cage.localhost", TLS: TLS{SelfSigned: true}}
	if err := cfg.TLS.serve(srv, cfg, logger); err != nil {
		t.Fatal(err)
	}
	own = testutil.SyncBuffer{} // what serve said of the CA
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = serveProxy(srv, l) }()
	defer srv.Close()
	const n = 20
	for i := range n {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		switch i % 3 {
		case 0: // nothing
		case 1:
			tc := tls.Client(c, &tls.Config{ServerName: "evil.example", InsecureSkipVerify: true})
			_ = tc.Handshake()
		case 2:
			_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
			_, _ = io.ReadAll(c)
		}
		c.Close()
	}
	time.Sleep(300 * time.Millisecond) // the server's side of the last ones
	if s := std.String(); s != "" {
		t.Errorf("%d lines to the standard logger for %d failed handshakes: %.300s", strings.Count(s, "\n"), n, s)
	}
	if lines := strings.Count(own.String(), "\n"); lines > 3 {
		t.Errorf("%d lines in the daemon's log for %d failed handshakes in a moment: %.300s", lines, n, own.String())
	}
}

// TestStandardLoggerBounded: a reverse proxy of the daemon's that has no
// error log of its own (the cluster front's, relaying traffic and API
// calls to the node that holds a sandbox) writes net/http's line for each
// answer that breaks off to the standard logger; a tenant's server on a
// public port breaks off every answer, and anyone asks it as fast as it
// likes. Expected: while the daemon runs, the standard logger's lines go
// to the daemon's log at most once a second, with how many were left out
// (found by review, 2026-12-04: a line each, to stderr).
func TestStandardLoggerBounded(t *testing.T) {
	var std, own testutil.SyncBuffer
	log.SetOutput(&std)
	defer log.SetOutput(os.Stderr)
	restore := boundStandardLog(slog.New(slog.NewTextHandler(&own, nil)))
	sandbox := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = brw.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nx")
		_ = brw.Flush()
	}))
	defer sandbox.Close()
	target, _ := url.Parse(sandbox.URL)
	front := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target) }})
	defer front.Close()
	const n = 20
	for range n {
		resp, err := http.Get(front.URL)
		if err != nil {
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if s := std.String(); s != "" {
		t.Errorf("%d lines to stderr for %d broken-off answers: %.300s", strings.Count(s, "\n"), n, s)
	}
	if lines := strings.Count(own.String(), "\n"); lines < 1 || lines > 3 {
		t.Errorf("%d lines in the daemon's log for %d broken-off answers in a moment (want 1 to 3): %.300s", lines, n, own.String())
	}
	restore()
	log.Print("after")
	if !strings.Contains(std.String(), "after") {
		t.Errorf("the standard logger was not given back: %q", std.String())
	}
}
