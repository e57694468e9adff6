package api

import (
	"bytes"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// TestBuildLogKept: a build's log keeps its last maxBuildLog bytes however
// much is written; a read from before them starts at them and says so
// (truncated); a UTF-8 sequence cut at the end waits for its rest while
// the build runs; the end is read whole.
func TestBuildLogKept(t *testing.T) {
	b := &buildRun{changed: make(chan struct{}), state: types.TemplateBuildStateBuilding}
	line := []byte(strings.Repeat("x", 1023) + "\n")
	for range 3 * 1024 { // 3 MiB
		b.Write(line)
	}
	if len(b.log) > 2*maxBuildLog {
		t.Fatalf("the log holds %d bytes, want at most %d", len(b.log), 2*maxBuildLog)
	}
	l, _, done := b.from(0)
	total := int64(3 << 20)
	if done || !l.Truncated || l.Offset != total-maxBuildLog || l.Next != total || len(l.Text) != maxBuildLog {
		t.Errorf("read from 0 of 3 MiB: offset %d next %d len %d truncated %v done %v", l.Offset, l.Next, len(l.Text), l.Truncated, done)
	}
	if v := b.view(true); v.LogOffset != total-maxBuildLog || len(v.Log) != maxBuildLog {
		t.Errorf("the build's log: from %d, %d bytes", v.LogOffset, len(v.Log))
	}
	l, more, _ := b.from(total)
	if l.Text != "" || l.Truncated || l.Next != total {
		t.Errorf("read at the end: %+v", l)
	}
	euro := []byte("€") // 3 bytes
	b.Write(append([]byte("a"), euro[:2]...))
	select {
	case <-more:
	default:
		t.Error("a write does not wake a reader")
	}
	if l, _, _ = b.from(total); l.Text != "a" || l.Next != total+1 {
		t.Errorf("a cut rune is sent: %q next %d", l.Text, l.Next)
	}
	b.Write(euro[2:])
	if l, _, _ = b.from(total + 1); l.Text != "€" {
		t.Errorf("the rune once whole: %q", l.Text)
	}
	b.Write([]byte{0xe2})
	b.finish(types.TemplateBuildStateFailed, "why", "")
	if l, _, done = b.from(total + 4); !done || !bytes.Equal([]byte(l.Text), []byte{0xe2}) || l.Error != "why" || l.State != types.TemplateBuildLogStateFailed {
		t.Errorf("the end: %+v done %v", l, done)
	}
}
