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
