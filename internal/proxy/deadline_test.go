package proxy

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestWriteProgressBounded: a handler behind WriteProgress whose client
// reads nothing of a large answer gets a write error within relayWrite of
// its last write getting through, and returns (before, it waited for good,
// holding what it built: found by review, 2026-12-03, 50 MiB an /mcp
// answer).
func TestWriteProgressBounded(t *testing.T) {
	defer func(d time.Duration) { relayWrite = d }(relayWrite)
	relayWrite = 500 * time.Millisecond
	done := make(chan error, 1)
	srv := httptest.NewServer(WriteProgress(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := bytes.Repeat([]byte("x"), 1<<20)
		for range 64 {
			if _, err := w.Write(chunk); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	})))
	defer srv.Close()
	c, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	select { // never read
	case err := <-done:
		if err == nil {
			t.Fatal("64 MiB written to a client that reads nothing")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the handler still waits on a client that reads nothing, 20 s later")
	}
}

// TestRefusalsToAStalledClientEnd: the proxy's own answers (a refusal)
// to an HTTP/2 client whose streams may receive nothing (a window of 0)
// end within answerWrite: each held its handler and request for good.
func TestRefusalsToAStalledClientEnd(t *testing.T) {
	defer func(d time.Duration) { answerWrite = d }(answerWrite)
	answerWrite = 500 * time.Millisecond
	a := newFakeAgent(t)
	px := New(sandboxes{sb{a}}, "", nil)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	srv := httptest.NewUnstartedServer(px)
	srv.Config.Protocols = &protos
	srv.Start()
	defer srv.Close()
	g0 := runtime.NumGoroutine()
	c, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 0}); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	const n = 32
	for i := range n {
		buf.Reset()
		for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":path", "/"}, {":authority", "x"}} {
			_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: buf.Bytes(),
			EndStream: true, EndHeaders: true}); err != nil {
			t.Fatal(err)
		}
	}
	// The connection's own goroutines stay; the handlers must go.
	time.Sleep(200 * time.Millisecond)
	held := runtime.NumGoroutine() - g0
	for deadline := time.Now().Add(20 * time.Second); runtime.NumGoroutine()-g0 > 8; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines (%d a moment after the requests) still held by %d refused requests to a stalled client 20 s later",
				runtime.NumGoroutine()-g0, held, n)
		}
	}
	if held < n {
		t.Logf("only %d goroutines were held a moment after the %d requests: the client did not stall them", held, n)
	}
}

// TestQuietStreamOverHTTP2: over HTTP/2 a relayed answer may be slow to
// start and a stream may stay quiet longer than a write's bound; only a
// write that does not get through is bounded. Before (found by review,
// 2026-12-04): HTTP/2 resets a stream when its write deadline passes,
// written or not, so an answer whose head took longer than answerWrite
// (10 s), or a stream quiet for relayWrite (30 s: a command that prints
// nothing for half a minute, an idle dashboard terminal, a watch), was
// reset on h2c clients (cage's own, through the proxy).
func TestQuietStreamOverHTTP2(t *testing.T) {
	defer func(a, r time.Duration) { answerWrite, relayWrite = a, r }(answerWrite, relayWrite)
	answerWrite, relayWrite = 200*time.Millisecond, 300*time.Millisecond
	for _, path := range []string{"/late", "/hold"} {
		t.Run(path, func(t *testing.T) {
			a := newFakeAgent(t)
			var protos http.Protocols
			protos.SetUnencryptedHTTP2(true)
			srv := httptest.NewUnstartedServer(New(sandboxes{sb{a}}, "", nil))
			srv.Config.Protocols = &protos
			srv.Start()
			defer srv.Close()
			var cp http.Protocols
			cp.SetUnencryptedHTTP2(true)
			c := &http.Client{Transport: &http.Transport{Protocols: &cp}}
			defer c.CloseIdleConnections()
			go func() { time.Sleep(4 * relayWrite); a.letGo() }()
			req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
			req.Header.Set("E2b-Sandbox-Id", "sandbox1")
			req.Header.Set("X-Access-Token", "the-token")
			resp, err := c.Do(req)
			if err != nil {
				t.Fatalf("an answer whose head came after %v: %v", 4*relayWrite, err)
			}
			defer resp.Body.Close()
			if resp.ProtoMajor != 2 {
				t.Fatalf("HTTP/%d, want 2", resp.ProtoMajor)
			}
			if _, err := io.ReadAll(resp.Body); err != nil || resp.StatusCode != http.StatusOK {
				t.Errorf("a stream quiet for %v: %d %v", 4*relayWrite, resp.StatusCode, err)
			}
		})
	}
}
