package microvm

import (
	"bufio"
	"io"
	"strings"
	"testing"
)

// endless is a guest that sends bytes without a newline for ever.
type endless struct{ n int }

func (e *endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	e.n += len(p)
	return len(p), nil
}

// TestReadLineMax: a line the host reads from a guest before its session
// is bounded: an endless one is refused once past the bound, having read
// little more than it; lines within it come whole, and a stream that
// ends says so.
func TestReadLineMax(t *testing.T) {
	g := &endless{}
	if _, err := readLineMax(bufio.NewReader(g), maxGuestLine); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Fatalf("an endless line: %v; want it refused", err)
	}
	if g.n > 2*maxGuestLine {
		t.Errorf("read %d bytes of an endless line, bound %d", g.n, maxGuestLine)
	}
	long := strings.Repeat("y", 10000) + "\n"
	r := bufio.NewReader(strings.NewReader("ready\n" + long + "tail"))
	for _, want := range []string{"ready\n", long} {
		if got, err := readLineMax(r, maxGuestLine); err != nil || got != want {
			t.Fatalf("line %.10q...: got %.10q..., %v", want, got, err)
		}
	}
	if got, err := readLineMax(r, maxGuestLine); err != io.EOF || got != "tail" {
		t.Errorf("the end: %q, %v; want \"tail\", EOF", got, err)
	}
}
