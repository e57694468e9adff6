// Package channel is the wire between the host and an agent that the host
// can neither hand a listening socket (gVisor imports a passed socket only
// as a connected one) nor dial at a path the sandbox can write (root
// inside could put a symlink or a socket of its own there). The direction
// is reversed: the host listens on a socket in a directory the sandbox
// sees read-only; the agent connects out, once, at start, through a
// descriptor of that directory it opened before any command existed; it
// proves it holds the sandbox's channel key (a secret the host made, which
// no command ever sees); and the host then opens one yamux stream per
// connection to the agent over that connection, as the microvm wall does
// over its virtio-serial port. When the host goes (a daemon killed), the
// agent connects again, to whoever listens there next: the daemon that
// adopts the sandbox.
package channel

import (
	"bufio"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/hashicorp/yamux"
)

// KeyBytes is the size of a channel key.
const KeyBytes = 32

// NewKey makes a channel key.
func NewKey() ([]byte, error) {
	k := make([]byte, KeyBytes)
	if _, err := rand.Read(k); err != nil {
		return nil, err
	}
	return k, nil
}

// SessionConfig is the yamux configuration of both ends of a channel (and
// of the microvm wall's port).
func SessionConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.LogOutput = io.Discard
	c.EnableKeepAlive = false // a private wire: its end is the peer's end
	// yamux closes the session when one write waits this long. A guest
	// under TCG that is reclaiming memory for an OOM kill, on a busy host,
	// can stall for more than yamux's 10 s without anything being wrong.
	c.ConnectionWriteTimeout = time.Minute
	// A stream one end closed waits for the other's close this long at
	// most (yamux: 5 min), holding what the other end sent meanwhile, up
	// to its window (256 KiB): a sandbox's server that answered each of
	// the proxy's requests and never closed held 200 streams and 50 MiB of
	// the daemon's per 200 requests for 5 min (found by review,
	// 2026-12-05). Nothing of the host's reads a stream after closing it.
	c.StreamCloseTimeout = streamCloseTimeout
	return c
}

// streamCloseTimeout is SessionConfig's StreamCloseTimeout (a variable for
// the tests).
var streamCloseTimeout = 10 * time.Second

// Client starts the host's end of a session on conn (the agent, or a
// microvm guest, serves). The agent is not trusted: the host tells it at
// once that it takes no streams (yamux's go-away), so that a stream the
// agent opens anyway is reset on arrival and what it sends on one is
// discarded, never buffered.
//
// Nor may it ask for pings: yamux answers each from a goroutine of its own
// that waits up to ConnectionWriteTimeout for the wire, so a peer sending
// pings and reading nothing made the host grow without bound (400,000
// goroutines and 1.3 GiB in under 3 s). An honest peer sends none (the
// host pings; keep-alive is off on both ends): the session ends at the
// maxPeerPings+1st.
func Client(conn io.ReadWriteCloser) (*yamux.Session, error) {
	guarded := struct {
		io.Reader
		io.Writer
		io.Closer
	}{&pingGuard{r: conn}, conn, conn}
	sess, err := yamux.Client(guarded, SessionConfig())
	if err != nil {
		return nil, err
	}
	if err := sess.GoAway(); err != nil {
		sess.Close()
		return nil, err
	}
	return sess, nil
}

// maxPeerPings is how many pings a peer may ask the host to answer in a
// session.
const maxPeerPings = 16

// errPings ends a session whose peer asked for more than maxPeerPings.
var errPings = errors.New("channel: the peer asked for too many pings")

// pingGuard passes a yamux connection's bytes on to the host's session,
// reading their frames as it goes (a 12-byte header: version, type,
// flags, stream, length; a data frame's payload of length bytes follows,
// no other type has one) and failing once the peer has asked for more
// than maxPeerPings answers (a ping with SYN).
type pingGuard struct {
	r       io.Reader
	hdr     [12]byte
	hdrN    int    // bytes of the current header read
	payload uint32 // bytes of a data frame's payload still to come
	pings   int
}

func (g *pingGuard) Read(p []byte) (int, error) {
	n, err := g.r.Read(p)
	if serr := g.scan(p[:n]); serr != nil {
		return 0, serr
	}
	return n, err
}

func (g *pingGuard) scan(b []byte) error {
	const typeData, typePing, flagSYN = 0, 2, 1
	for len(b) > 0 {
		if g.payload > 0 {
			k := min(uint32(len(b)), g.payload)
			b, g.payload = b[k:], g.payload-k
			continue
		}
		k := copy(g.hdr[g.hdrN:], b)
		g.hdrN += k
		b = b[k:]
		if g.hdrN < len(g.hdr) {
			return nil
		}
		g.hdrN = 0
		flags, length := binary.BigEndian.Uint16(g.hdr[2:4]), binary.BigEndian.Uint32(g.hdr[8:12])
		switch g.hdr[1] {
		case typeData:
			g.payload = length
		case typePing:
			if flags&flagSYN != 0 {
				if g.pings++; g.pings > maxPeerPings {
					return errPings
				}
			}
		}
	}
	return nil
}

// The handshake: the host writes greeting, a space and a fresh nonce (hex)
// on a line; the agent answers with proof(key, nonce) (hex) on a line.
const greeting = "cage-channel/1"

// handshakeTimeout bounds a handshake on either end.
const handshakeTimeout = 10 * time.Second

// maxLine bounds a handshake line.
const maxLine = 256

// proof is what the agent answers to nonce: an HMAC of it under the key.
func proof(key, nonce []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(greeting + " agent\x00"))
	m.Write(nonce)
	return m.Sum(nil)
}

// readLine reads one line of at most maxLine bytes, without its newline.
func readLine(r *bufio.Reader) (string, error) {
	var b strings.Builder
	for b.Len() <= maxLine {
		c, err := r.ReadByte()
		if err != nil {
			return "", err
		}
		if c == '\n' {
			return b.String(), nil
		}
		b.WriteByte(c)
	}
	return "", errors.New("channel: handshake line too long")
}

// challenge is the host's half of the handshake on rw: nil once the peer
// has proved it holds key.
func challenge(rw io.ReadWriter, key []byte) error {
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		return err
	}
	if _, err := io.WriteString(rw, greeting+" "+hex.EncodeToString(nonce)+"\n"); err != nil {
		return err
	}
	line, err := readLine(bufio.NewReaderSize(oneByte{rw}, 16))
	if err != nil {
		return err
	}
	got, err := hex.DecodeString(line)
	if err != nil || !hmac.Equal(got, proof(key, nonce)) {
		return errors.New("channel: the peer does not hold the sandbox's key")
	}
	return nil
}

// respond is the agent's half of the handshake on rw. Both halves read
// byte by byte: nothing past the handshake may be consumed, since yamux
// reads the connection next.
func respond(rw io.ReadWriter, key []byte) error {
	line, err := readLine(bufio.NewReaderSize(oneByte{rw}, 16))
	if err != nil {
		return err
	}
	nonceHex, ok := strings.CutPrefix(line, greeting+" ")
	if !ok {
		return fmt.Errorf("channel: unexpected greeting %q", line)
	}
	nonce, err := hex.DecodeString(nonceHex)
	if err != nil || len(nonce) != 32 {
		return fmt.Errorf("channel: malformed nonce")
	}
	_, err = io.WriteString(rw, hex.EncodeToString(proof(key, nonce))+"\n")
	return err
}

// oneByte reads at most a byte at a time, so that a bufio.Reader over it
// never reads ahead.
type oneByte struct{ r io.Reader }

func (o oneByte) Read(p []byte) (int, error) {
	if len(p) > 1 {
		p = p[:1]
	}
	return o.r.Read(p)
}
