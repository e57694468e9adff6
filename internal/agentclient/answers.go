package agentclient

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// The agent is not trusted, and Connect's client bounds less of what it
// reads than WithReadMaxBytes says: an error answer to a unary call is
// read whole and inflated whole (no bound at all), and a stream's end
// message, bounded as any message (4 MiB), is JSON whose error details
// decode to some 120 times its bytes. Found by review, 2026-12-05: a
// unary error of 256 MiB cost the host 1.5 GiB and was all of the
// error's message; an end message of 4 MiB, 507 MiB. guardAnswer bounds
// both on the transport, before Connect reads them: an error answer (a
// status of 300 or more) to at most maxErrorAnswer bytes, inflated here
// within the same bound where the agent compressed it; a stream's end
// message the same (its other messages pass as they come).

// maxErrorAnswer bounds an error answer's bytes and a stream's end
// message's, inflated: an honest agent's are a code and a line.
const maxErrorAnswer = 64 << 10

var errAnswerTooLarge = fmt.Errorf("the agent's error answer is larger than %d KiB", maxErrorAnswer>>10)

// guardAnswer bounds what resp's body may make the host hold (see above).
func guardAnswer(resp *http.Response) (*http.Response, error) {
	switch {
	case resp.StatusCode >= 300:
		enc := strings.TrimSpace(resp.Header.Get("Content-Encoding"))
		if enc == "" || strings.EqualFold(enc, "identity") {
			resp.Body = &boundedBody{ReadCloser: resp.Body, left: maxErrorAnswer}
			return resp, nil
		}
		// Inflated here, within the bound, and passed on as it is sent
		// plain (an honest agent compresses no error).
		b, err := readErrorAnswer(resp.Body, enc)
		resp.Body.Close()
		if err != nil {
			return nil, err
		}
		resp.Header.Del("Content-Encoding")
		resp.ContentLength = int64(len(b))
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return resp, nil
	case strings.HasPrefix(resp.Header.Get("Content-Type"), "application/connect+"):
		resp.Body = &endGuard{rc: resp.Body,
			gzip: strings.EqualFold(strings.TrimSpace(resp.Header.Get("Connect-Content-Encoding")), "gzip")}
	}
	return resp, nil
}

// readErrorAnswer reads an error answer compressed with enc, at most
// maxErrorAnswer bytes of it and of what it inflates to.
func readErrorAnswer(r io.Reader, enc string) ([]byte, error) {
	if !strings.EqualFold(enc, "gzip") {
		return nil, fmt.Errorf("the agent's error answer is in an unknown encoding %q", clipped(enc, 32))
	}
	zr, err := gzip.NewReader(io.LimitReader(r, maxErrorAnswer))
	if err != nil {
		return nil, fmt.Errorf("the agent's error answer: %w", err)
	}
	b, err := io.ReadAll(io.LimitReader(zr, maxErrorAnswer+1))
	if err != nil {
		return nil, fmt.Errorf("the agent's error answer: %w", err)
	}
	if len(b) > maxErrorAnswer {
		return nil, errAnswerTooLarge
	}
	return b, nil
}

func clipped(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// boundedBody fails a read past left bytes.
type boundedBody struct {
	io.ReadCloser
	left int64
}

func (b *boundedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, errAnswerTooLarge
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// Connect's envelope: a flags byte and a big-endian length, then that
// many bytes of message.
const (
	flagCompressed = 1
	flagEndStream  = 2
)

// endGuard passes a Connect stream's messages through as they come, but
// for its end message, which it reads whole (at most maxErrorAnswer
// bytes) and passes on inflated (within the same bound) where it was
// compressed with gzip.
type endGuard struct {
	rc      io.ReadCloser
	gzip    bool   // the stream's messages are gzip's where flagged
	pending []byte // what to hand on before reading more
	left    uint32 // bytes of the current message still to pass through
	hdr     [5]byte
	err     error // the body's failure, handed on after pending
}

func (g *endGuard) Close() error { return g.rc.Close() }

func (g *endGuard) Read(p []byte) (int, error) {
	for {
		if len(g.pending) > 0 {
			n := copy(p, g.pending)
			g.pending = g.pending[n:]
			return n, nil
		}
		if g.err != nil {
			// A body that failed keeps failing, with no bytes (the
			// transport's io.ErrUnexpectedEOF for a cut stream): read
			// again, it was a loop that spun a daemon goroutine.
			return 0, g.err
		}
		if g.left > 0 {
			if uint32(len(p)) > g.left {
				p = p[:g.left]
			}
			n, err := g.rc.Read(p)
			g.left -= uint32(n)
			return n, err
		}
		if n, err := io.ReadFull(g.rc, g.hdr[:]); err != nil {
			// What came of a cut envelope is handed on (Connect says
			// what it means), then the failure.
			g.pending, g.err = append([]byte(nil), g.hdr[:n]...), err
			continue
		}
		size := binary.BigEndian.Uint32(g.hdr[1:])
		if g.hdr[0]&flagEndStream == 0 {
			g.pending, g.left = append([]byte(nil), g.hdr[:]...), size
			continue
		}
		if size > maxErrorAnswer {
			return 0, fmt.Errorf("the agent's end of stream is larger than %d KiB", maxErrorAnswer>>10)
		}
		msg := make([]byte, size)
		if _, err := io.ReadFull(g.rc, msg); err != nil {
			return 0, err
		}
		flags := g.hdr[0]
		if flags&flagCompressed != 0 && g.gzip && size > 0 {
			b, err := readErrorAnswer(bytes.NewReader(msg), "gzip")
			if err != nil {
				return 0, err
			}
			msg, flags = b, flags&^flagCompressed
		}
		out := make([]byte, 5, 5+len(msg))
		out[0] = flags
		binary.BigEndian.PutUint32(out[1:], uint32(len(msg)))
		g.pending = append(out, msg...)
	}
}
