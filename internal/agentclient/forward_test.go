package agentclient

import (
	"bufio"
	"context"
	"io"
	"net"
	"strings"
	"testing"
)

// agentAnswering serves one CONNECT with answer written after the request.
func agentAnswering(t *testing.T, answer func(w *bufio.Writer)) DialFunc {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			line, err := br.ReadString('\n')
			if err != nil || line == "\r\n" {
				break
			}
		}
		w := bufio.NewWriter(c)
		answer(w)
		_ = w.Flush()
		_, _ = io.Copy(io.Discard, c)
	}()
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", l.Addr().String())
	}
}

// TestDialPortBoundsTheAnswer: an agent (not trusted) answering a port's
// CONNECT with headers that do not end (here 4 MiB) gets an error once
// 16 KiB are read; the host does not read on (before: all of it, without
// a bound, for up to the dial's 30 s: 2 GiB of heap in a review's run).
func TestDialPortBoundsTheAnswer(t *testing.T) {
	dial := agentAnswering(t, func(w *bufio.Writer) {
		w.WriteString("HTTP/1.1 200 OK\r\n")
		v := strings.Repeat("v", 1000)
		for range 4096 {
			w.WriteString("X-Long: " + v + "\r\n")
		}
		w.WriteString("\r\n")
	})
	c, err := DialPort(context.Background(), dial, "tok", 8080)
	if err == nil {
		c.Close()
		t.Fatal("a 4 MiB answer to CONNECT was taken")
	}
	if !strings.Contains(err.Error(), "too long") {
		t.Errorf("error %q, want the answer too long", err)
	}
}

// TestDialPortCarriesBytes: what follows an answer of ordinary size,
// sent with it, reaches the caller, however the head was read.
func TestDialPortCarriesBytes(t *testing.T) {
	payload := strings.Repeat("p", 40<<10)
	dial := agentAnswering(t, func(w *bufio.Writer) {
		w.WriteString("HTTP/1.1 200 OK\r\nX-Some: " + strings.Repeat("h", 12<<10) + "\r\n\r\n" + payload)
	})
	c, err := DialPort(context.Background(), dial, "tok", 8080)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != payload {
		t.Errorf("read %d bytes of the port's %d: %v", len(strings.TrimRight(string(got), "\x00")), len(payload), err)
	}
}
