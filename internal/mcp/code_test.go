package mcp

import (
	"io"
	"runtime"
	"strings"
	"testing"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// repeated is a stream of the same NDJSON line, n times, then the end.
type repeated struct {
	line, end []byte
	left, off int
}

func (l *repeated) Read(p []byte) (int, error) {
	if l.left == 0 {
		if l.off >= len(l.end) {
			return 0, io.EOF
		}
		n := copy(p, l.end[l.off:])
		l.off += n
		return n, nil
	}
	n := copy(p, l.line[l.off:])
	l.off += n
	if l.off == len(l.line) {
		l.off = 0
		l.left--
	}
	return n, nil
}

// TestRunCodeResultsBounded: a server on the interpreter's port (code in
// the tenant's sandbox may replace it) answering with 300 result lines of
// 2 MiB each (text and JSON) leaves the daemon holding at most its bounds:
// 64 results, 1 MiB of their text and JSON, and says what it left out.
// (Before: every line's JSON and the whole line under each clipped text,
// 428 MiB of heap for 400 lines in a review's run, for up to an hour.)
func TestRunCodeResultsBounded(t *testing.T) {
	big := strings.Repeat("A", 1<<20)
	stream := &repeated{line: []byte(`{"type":"result","text":"` + big + `","json":"` + big + `","extra":{"x":1}}` + "\n"),
		left: 300, end: []byte(`{"type":"end_of_execution"}` + "\n")}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := &codeRun{stdout: newCapture(1 << 10), stderr: newCapture(1 << 10)}
	if err := r.read(stream); err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 8<<20 {
		t.Errorf("the daemon holds %d MiB more after 600 MiB of results", grown>>20)
	}
	if len(r.results) > maxResults || r.kept > maxResultBytes {
		t.Errorf("%d results, %d bytes kept", len(r.results), r.kept)
	}
	_, out, err := r.answer()
	if err != nil {
		t.Fatal(err)
	}
	if !out.Truncated || len(out.Results) == 0 {
		t.Errorf("answer: truncated %v, %d results", out.Truncated, len(out.Results))
	}
	res, _, _ := r.answer()
	if tc, ok := res.Content[0].(*sdk.TextContent); !ok || !strings.Contains(tc.Text, "cage: left out: results past the first") {
		t.Errorf("the answer does not say results were left out: %+v", res.Content[0])
	}
	runtime.KeepAlive(r)
}
