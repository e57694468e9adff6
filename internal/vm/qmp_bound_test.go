package vm

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestQMPAnswerBounded: a QEMU (a guest escaped into it) that answers with
// a message that never ends costs the host at most a line's bound, and
// the call fails at once; events it floods between replies are kept to a
// bound (an endless answer once took 1.5 GiB of the daemon's heap; found
// by review, 2026-12-03).
func TestQMPAnswerBounded(t *testing.T) {
	dir := t.TempDir()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, QMPSocket), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() { // the compromised QEMU
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		c.Write([]byte(`{"QMP": {"version": {}, "capabilities": []}}` + "\r\n"))
		buf := make([]byte, 4096)
		c.Read(buf) // qmp_capabilities
		ev := []byte(`{"event": "X", "data": {}}` + "\r\n")
		c.Write(bytes.Repeat(ev, 10000)) // a flood of events before the reply
		c.Write([]byte(`{"return": {}}` + "\r\n"))
		c.Read(buf) // the next command
		c.Write([]byte(`{"return": "`))
		chunk := bytes.Repeat([]byte("A"), 1<<20)
		for range 64 { // 64 MiB at most: it stops once the host hangs up
			if _, err := c.Write(chunk); err != nil {
				return
			}
		}
	}()
	c, err := net.Dial("unix", filepath.Join(dir, QMPSocket))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := newQMP(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if len(q.events) > maxQMPEvents {
		t.Errorf("%d events kept, at most %d", len(q.events), maxQMPEvents)
	}
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err = q.call(ctx, "x-query-virtio", nil)
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("an endless answer: %v, want an error naming the bound", err)
	}
	if grew := int64(after.TotalAlloc - before.TotalAlloc); grew > 8*maxQMPLine {
		t.Errorf("reading the endless answer allocated %d MiB", grew>>20)
	}
}
