package audit

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// How the proxy's envd traffic is read: Connect RPCs (unary: the body is
// the message; streams and gRPC: 5-byte envelopes, flags then a big-endian
// length), in JSON (the JS SDK) or protobuf (Go clients), gzip-compressed
// where the client or the agent chose. The host reads what passes without
// holding it back: requests are copied as they stream (up to a bound) and
// decoded once complete; responses are scanned envelope by envelope, small
// messages decoded, large ones (output) skipped.

// codec is how an RPC's messages are encoded.
type codec struct {
	json     bool
	envelope bool   // 5-byte envelopes (streams, gRPC)
	gzip     bool   // messages (or, unary, the body) gzip-compressed
	endJSON  bool   // an end-of-stream message (flag 0x02) is Connect's JSON
	media    string // the content type's media type
}

// codecOf reads a request's or response's content type and compression
// headers.
func codecOf(h http.Header) codec {
	media, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	c := codec{media: media}
	switch {
	case strings.HasPrefix(media, "application/connect+"):
		c.envelope, c.endJSON = true, true
		c.json = strings.HasSuffix(media, "+json")
		c.gzip = strings.EqualFold(h.Get("Connect-Content-Encoding"), "gzip")
	case strings.HasPrefix(media, "application/grpc"):
		c.envelope = true
		c.json = strings.HasSuffix(media, "+json")
		c.gzip = strings.EqualFold(h.Get("Grpc-Encoding"), "gzip")
	default:
		c.json = media == "application/json"
		c.gzip = strings.EqualFold(h.Get("Content-Encoding"), "gzip")
	}
	return c
}

// maxDecoded bounds a message the host decodes for the trail (a process's
// argv and environment, a path).
const maxDecoded = 1 << 20

var errTooLarge = errors.New("larger than the audit trail decodes")

// gunzip inflates b, at most limit bytes, with a pooled reader. Past
// the limit it returns errTooLarge with what it inflated (limit+1 bytes),
// so that a caller may count it.
func gunzip(b []byte, limit int) ([]byte, error) {
	zr, _ := gzipReaders.Get().(*gzip.Reader)
	var err error
	if zr == nil {
		zr, err = gzip.NewReader(bytes.NewReader(b))
	} else {
		err = zr.Reset(bytes.NewReader(b))
	}
	if err != nil {
		return nil, err
	}
	defer gzipReaders.Put(zr)
	out, err := io.ReadAll(io.LimitReader(zr, int64(limit)+1))
	if err != nil {
		return out, err
	}
	if len(out) > limit {
		return out, errTooLarge
	}
	return out, nil
}

var gzipReaders sync.Pool

// unmarshal decodes one message in the codec's encoding.
func (c codec) unmarshal(b []byte, m proto.Message) error {
	if c.json {
		return protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, m)
	}
	return proto.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, m)
}

// maxFilesystemMessage bounds a filesystem RPC's message the trail
// inflates and decodes: the agent's own bound (internal/agent's
// rpcOptions), past which it refuses the call. Found by review,
// 2026-12-04: such messages were inflated to 1 MiB, so a tenant's
// compressed Remove of 1 KiB naming a path of 1 MiB cost the daemon 2 MiB
// of allocations and its decoding, 16 times what the agent spends before
// refusing it, at the rate the tenant sent them.
const maxFilesystemMessage = 64 << 10

// decodeRequest decodes a captured request body: its first message, of
// at most limit bytes (inflated).
func (c codec) decodeRequest(body []byte, m proto.Message, limit int) error {
	msg := body
	compressed := c.gzip
	if c.envelope {
		if len(body) < 5 {
			return io.ErrUnexpectedEOF
		}
		n := binary.BigEndian.Uint32(body[1:5])
		if uint64(len(body)-5) < uint64(n) {
			return io.ErrUnexpectedEOF
		}
		msg, compressed = body[5:5+n], body[0]&1 != 0
	}
	if compressed {
		var err error
		if msg, err = gunzip(msg, limit); err != nil {
			return err
		}
	}
	if len(msg) > limit {
		return errTooLarge
	}
	return c.unmarshal(msg, m)
}

// capture copies what passes through a request body, up to limit bytes.
// The transport reads the body in a goroutine of its own: bytes() is
// safe to call meanwhile.
type capture struct {
	rc    io.ReadCloser
	limit int
	// enveloped: the body's first message is whole once its 5-byte
	// prefix and the length it names have passed (else at the body's
	// end). whole, when set, is called once then, on the reading
	// goroutine, without the lock held.
	enveloped bool
	whole     func()

	mu       sync.Mutex
	buf      []byte
	over     bool
	released bool
	called   bool
	expired  bool        // the message was not whole within wholeWithin
	timer    *time.Timer // ends the wait for a message to be whole
	n        int64
}

// wholeWithin bounds the time a request's message, while the trail keeps
// its bytes (at most maxDecoded), has to arrive whole, as the API gives a
// body of 1 MiB a minute: past it the bytes are let go and the request
// fails (errNotWhole), so that its message never reaches the agent
// undecoded. Found by review, 2026-12-04: a client that sent 1 MiB of a
// message and held back the rest held 2 MiB of the daemon for as long as
// it liked (200 such requests, 400 MiB). A variable for the tests.
var wholeWithin = time.Minute

var errNotWhole = errors.New("audit: the request's message did not arrive within " + wholeWithin.String())

func newCapture(rc io.ReadCloser, limit int) *capture {
	c := &capture{rc: rc, limit: limit}
	c.timer = time.AfterFunc(wholeWithin, c.expire)
	return c
}

// expire lets go of a message not whole in time; the body's next read
// fails.
func (c *capture) expire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.called {
		c.expired, c.buf, c.over = true, nil, true
	}
}

func (c *capture) Read(p []byte) (int, error) {
	n, err := c.rc.Read(p)
	c.mu.Lock()
	if c.expired {
		c.mu.Unlock()
		return 0, errNotWhole
	}
	c.n += int64(n)
	if !c.over {
		if len(c.buf)+n <= c.limit {
			c.buf = append(c.buf, p[:n]...)
		} else {
			c.over, c.buf = true, nil
		}
	}
	call := false
	if !c.called && (err == io.EOF || c.over || c.released || c.firstMessageIn()) {
		c.called, call = true, c.whole != nil
		c.timer.Stop()
	}
	c.mu.Unlock()
	if call {
		c.whole()
	}
	return n, err
}

// firstMessageIn says whether the captured bytes hold the first
// enveloped message whole (c.mu held).
func (c *capture) firstMessageIn() bool {
	return c.enveloped && len(c.buf) >= 5 && uint64(len(c.buf)-5) >= uint64(binary.BigEndian.Uint32(c.buf[1:5]))
}

func (c *capture) Close() error { return c.rc.Close() }

// release lets go of what was captured (decoded already, or no longer
// needed): a stream may stay open for hours, and its request's bytes with
// it. Later bytes are counted, not kept.
func (c *capture) release() {
	c.mu.Lock()
	c.buf, c.over, c.released = nil, true, true
	c.called = true // nothing kept to wait for
	c.timer.Stop()
	c.mu.Unlock()
}

// bytes is what was captured, and whether the body was larger than the
// bound, and how many bytes passed in all.
func (c *capture) bytes() ([]byte, bool, int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf, c.over, c.n
}

// decodeCaptured decodes the captured request, or says why it cannot.
func decodeCaptured(c *capture, cd codec, m proto.Message) error {
	b, over, n := c.bytes()
	c.mu.Lock()
	released := c.released
	c.mu.Unlock()
	if released {
		return errors.New("request not kept")
	}
	if over {
		return fmt.Errorf("request of %d bytes or more: %w", n, errTooLarge)
	}
	limit := maxDecoded
	if strings.HasPrefix(string(m.ProtoReflect().Descriptor().FullName()), "filesystem.") {
		limit = maxFilesystemMessage
	}
	return cd.decodeRequest(b, m, limit)
}

// maxScanned bounds a response message the scanner decodes; larger ones
// are a process's output and are skipped.
const maxScanned = 64 << 10

// maxInspected bounds what the trail inflates and decodes of one
// response stream in all: an honest agent's start and end events are
// tens of bytes, and it compresses no message under 4 KiB. Found by
// review, 2026-12-04: every compressed message under 1 KiB was inflated
// (to up to 1 MiB) whatever came before, so a hostile agent's stream of
// gzip bombs cost the daemon some 2,000 times what it relayed (2.8 MB
// relayed, 6 GB allocated and 5 s of CPU), on every stream it answered.
const maxInspected = 1 << 20

// scanner passes a streamed response through and hands each envelope's
// message (those up to maxScanned bytes) to on, as they complete.
type scanner struct {
	rc    io.ReadCloser
	on    func(flags byte, msg []byte)
	hdr   [5]byte
	hn    int
	need  uint32
	keep  bool
	msg   []byte
	bytes int64
}

func (s *scanner) Read(p []byte) (int, error) {
	n, err := s.rc.Read(p)
	s.bytes += int64(n)
	s.feed(p[:n])
	return n, err
}

func (s *scanner) Close() error { return s.rc.Close() }

func (s *scanner) feed(b []byte) {
	for len(b) > 0 {
		if s.hn < 5 {
			k := copy(s.hdr[s.hn:], b)
			s.hn += k
			b = b[k:]
			if s.hn < 5 {
				return
			}
			s.need = binary.BigEndian.Uint32(s.hdr[1:])
			s.keep = s.need <= maxScanned
			s.msg = s.msg[:0]
			if s.need == 0 {
				s.deliver()
				continue
			}
		}
		k := min(uint32(len(b)), s.need)
		if s.keep {
			s.msg = append(s.msg, b[:k]...)
		}
		s.need -= k
		b = b[k:]
		if s.need == 0 {
			s.deliver()
		}
	}
}

func (s *scanner) deliver() {
	s.hn = 0
	if s.keep {
		s.on(s.hdr[0], s.msg)
	}
}

// processEventField is which event a StartResponse or ConnectResponse
// message carries (1 start, 2 data, 3 end, 4 keepalive; 0 unknown),
// without decoding the message: data events are skipped unread.
func processEventField(c codec, msg []byte) int {
	if c.json {
		switch {
		case bytes.Contains(msg, []byte(`"end"`)):
			return 3
		case bytes.Contains(msg, []byte(`"start"`)):
			return 1
		}
		return 0
	}
	num, typ, n := protowire.ConsumeTag(msg)
	if n < 0 || num != 1 || typ != protowire.BytesType {
		return 0
	}
	inner, m := protowire.ConsumeBytes(msg[n:])
	if m < 0 {
		return 0
	}
	num, _, n = protowire.ConsumeTag(inner)
	if n < 0 {
		return 0
	}
	return int(num)
}
