// Package jupyter is a client of Jupyter kernels that speaks their messaging
// protocol (jupyter_client's "Messaging in Jupyter", version 5.3) straight
// over ZeroMQ with a pure-Go library (github.com/go-zeromq/zmq4), without a
// Jupyter server: it launches a kernel from its kernelspec with a connection
// file of its own (IPC sockets in a private directory, a fresh HMAC key),
// connects the shell, control and IOPub sockets, and runs code on it,
// routing the kernel's messages to the request they answer.
//
// Why not a Jupyter server between (what E2B runs): measured here in one
// run on the same ipykernel (Debian 12's jupyter-server 1.23.3), a kernel
// took 390-405 ms from launch to its first answer directly, and 286 ms
// for the server to start plus 695 ms for it to start the kernel; `1+1`
// took p50 3.1-3.5 ms (p99 16-19 ms) directly and p50 48 ms (p99 578 ms)
// through the server's WebSocket; the server held 84 MiB with one kernel,
// cage-interp 8-14 MiB. The server would also be one more process per
// sandbox to start, watch and secure.
package jupyter

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// delimiter separates a message's routing frames from its body.
const delimiter = "<IDS|MSG>"

// protocolVersion is the messaging protocol version this client speaks.
const protocolVersion = "5.3"

// Header is a message's header (and, as parent_header, that of the
// request it answers).
type Header struct {
	MsgID    string `json:"msg_id"`
	Session  string `json:"session"`
	Username string `json:"username"`
	Date     string `json:"date"`
	MsgType  string `json:"msg_type"`
	Version  string `json:"version"`
}

// Message is one kernel message; Content is decoded by its type's reader.
type Message struct {
	Channel  string // the socket it came on: "shell", "control" or "iopub"
	Header   Header
	Parent   Header
	Metadata json.RawMessage
	Content  json.RawMessage
}

// Decode reads the message's content into v (NaN and Infinity, which
// Python's JSON may hold, become null).
func (m *Message) Decode(v any) error { return unmarshal(m.Content, v) }

// Time is when the kernel made the message (its header's date), or now.
func (m *Message) Time() time.Time {
	if t, err := time.Parse(time.RFC3339Nano, m.Header.Date); err == nil {
		return t
	}
	return time.Now()
}

// signer signs and checks messages with the connection's key (HMAC-SHA256).
type signer struct{ key []byte }

func (s signer) sign(parts ...[]byte) []byte {
	if len(s.key) == 0 {
		return nil
	}
	mac := hmac.New(sha256.New, s.key)
	for _, p := range parts {
		mac.Write(p)
	}
	sum := mac.Sum(nil)
	out := make([]byte, hex.EncodedLen(len(sum)))
	hex.Encode(out, sum)
	return out
}

// encode is a message as the frames a DEALER sends (no routing identities).
func (s signer) encode(h Header, content any) ([][]byte, error) {
	hb, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	cb, err := json.Marshal(content)
	if err != nil {
		return nil, err
	}
	parent, meta := []byte("{}"), []byte("{}")
	return [][]byte{[]byte(delimiter), s.sign(hb, parent, meta, cb), hb, parent, meta, cb}, nil
}

var errBadSignature = errors.New("jupyter: message signature does not match the connection key")

// decode reads a message from its frames (any routing frames first),
// checking its signature.
func (s signer) decode(frames [][]byte) (*Message, error) {
	i := 0
	for i < len(frames) && !bytes.Equal(frames[i], []byte(delimiter)) {
		i++
	}
	if len(frames)-i < 6 {
		return nil, fmt.Errorf("jupyter: malformed message (%d frames)", len(frames))
	}
	sig, body := frames[i+1], frames[i+2:i+6]
	if len(s.key) > 0 && !hmac.Equal(sig, s.sign(body...)) {
		return nil, errBadSignature
	}
	m := &Message{Metadata: body[2], Content: body[3]}
	if err := unmarshal(body[0], &m.Header); err != nil {
		return nil, fmt.Errorf("jupyter: header: %w", err)
	}
	if err := unmarshal(body[1], &m.Parent); err != nil {
		return nil, fmt.Errorf("jupyter: parent header: %w", err)
	}
	return m, nil
}

// unmarshal decodes JSON as Python's json module writes it, which may hold
// NaN and Infinity (not JSON): those become null.
func unmarshal(data []byte, v any) error {
	err := json.Unmarshal(data, v)
	if err == nil {
		return nil
	}
	if clean, changed := replaceNonFinite(data); changed {
		return json.Unmarshal(clean, v)
	}
	return err
}

// replaceNonFinite replaces the bare tokens NaN, Infinity and -Infinity
// outside strings with null.
func replaceNonFinite(data []byte) ([]byte, bool) {
	var out []byte
	changed, inString, escaped := false, false, false
	for i := 0; i < len(data); i++ {
		c := data[i]
		if inString {
			out = append(out, c)
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
			continue
		}
		if c == '"' {
			inString = true
		}
		matched := false
		for _, tok := range []string{"NaN", "-Infinity", "Infinity"} {
			if bytes.HasPrefix(data[i:], []byte(tok)) {
				out, i, matched, changed = append(out, "null"...), i+len(tok)-1, true, true
				break
			}
		}
		if !matched {
			out = append(out, c)
		}
	}
	return out, changed
}

// newID is a random message, session or kernel id (a UUID's form).
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// NewID is a fresh random id in the form Jupyter gives kernels (a UUID).
func NewID() string { return newID() }
