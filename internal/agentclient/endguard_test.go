package agentclient

import (
	"encoding/binary"
	"errors"
	"io"
	"testing"
	"time"
)

// cutBody is a stream's body the transport cut: after what it has, every
// read fails with err and no bytes (an HTTP/2 stream reset, the sandbox
// destroyed mid-stream: net/http answers io.ErrUnexpectedEOF each time).
type cutBody struct {
	data  []byte
	err   error
	reads int
}

func (c *cutBody) Read(p []byte) (int, error) {
	c.reads++
	if len(c.data) > 0 {
		n := copy(p, c.data)
		c.data = c.data[n:]
		return n, nil
	}
	return 0, c.err
}

func (c *cutBody) Close() error { return nil }

// TestEndGuardCutStream: a stream's body cut between messages, at the
// start of an envelope or inside its header, with the transport's
// io.ErrUnexpectedEOF on every read after. Expected: the guard hands on
// every byte that came (a message whole, a cut header's bytes) and then
// the cut, within a few reads; it never loops on the failing body (it did:
// a cut stream spun a daemon goroutine at 100% CPU, found by this
// session's third fresh run, the conformance suite's host at 32 CPU-minutes).
func TestEndGuardCutStream(t *testing.T) {
	msg := func(s string) []byte {
		b := make([]byte, 5, 5+len(s))
		binary.BigEndian.PutUint32(b[1:], uint32(len(s)))
		return append(b, s...)
	}
	for _, c := range []struct {
		name string
		data []byte
		err  error
	}{
		{"cut between messages", msg("hello"), io.ErrUnexpectedEOF},
		{"cut at once", nil, io.ErrUnexpectedEOF},
		{"cut inside a header", append(msg("hello"), 0, 0, 0), io.ErrUnexpectedEOF},
		{"reset", msg("hello"), errors.New("stream error: stream ID 3; CANCEL")},
	} {
		t.Run(c.name, func(t *testing.T) {
			body := &cutBody{data: append([]byte(nil), c.data...), err: c.err}
			g := &endGuard{rc: body}
			done := make(chan struct{})
			var got []byte
			var err error
			go func() {
				defer close(done)
				got, err = io.ReadAll(g)
			}()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				t.Fatalf("the guard still reads after 5 s (%d reads of the cut body)", body.reads)
			}
			if string(got) != string(c.data) {
				t.Errorf("handed on %q, want %q", got, c.data)
			}
			if err == nil || !errors.Is(err, c.err) && err.Error() != c.err.Error() {
				t.Errorf("ended with %v, want %v", err, c.err)
			}
			if body.reads > 10 {
				t.Errorf("%d reads of the cut body", body.reads)
			}
		})
	}
}
