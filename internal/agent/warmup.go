package agent

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// WarmUp has the agent serve one request of its own, over a socket pair
// that only this process holds, before it serves anyone: a process start
// with an empty command, as a client would send it over HTTP/2, which
// Start refuses (invalid_argument) before it looks anything up. A fresh agent's first request otherwise pays, on the way
// to its first output, for what every later one finds ready: the code of
// the HTTP/2 server, Connect and the protobuf runtime faulted in, their
// tables built, their buffers and goroutine stacks grown (about 2 ms here
// on a pooled sandbox's first command). Nothing is looked up, forked or
// run (a command of any name could be a file of a hostile template's,
// and the sandbox may go to another tenant), and nothing of the request
// stays but those caches: the connection is closed before WarmUp returns;
// the server, made once, serves the real listener next (Serve).
//
// A sandbox kept in a pool calls it while it waits for its request (see
// cage-agent's main); it must come before Configure and Serve, never
// beside them.
func (s *Server) WarmUp() error {
	WarmProtocol()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	server, err := fileConn(fds[0])
	if err != nil {
		unix.Close(fds[1])
		return err
	}
	client, err := fileConn(fds[1])
	if err != nil {
		server.Close()
		return err
	}
	defer client.Close() // the server's end then reads EOF and goes
	l := &oneConn{conn: server, done: make(chan struct{})}
	go func() { _ = s.httpServer().Serve(l) }()
	defer l.Close()
	_ = client.SetDeadline(time.Now().Add(warmUpTimeout))
	return warmRequest(client, s.cfg.Token)
}

// warmUpTimeout bounds WarmUp: it is a cache's warming, never a wait.
const warmUpTimeout = 2 * time.Second

func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "warm-up")
	defer f.Close()
	return net.FileConn(f)
}

// warmRequest writes an HTTP/2 (h2c, prior knowledge) request for
// Process.Start of an empty command and reads the answer to its end.
func warmRequest(c net.Conn, token string) error {
	body, err := proto.Marshal(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: ""}})
	if err != nil {
		return err
	}
	var hdr []byte
	hdr = append(hdr, 0x83, 0x86)                                        // :method POST, :scheme http (static table)
	hdr = hpackIndexedName(hdr, 4, processconnect.ProcessStartProcedure) // :path
	hdr = hpackIndexedName(hdr, 1, "agent")                              // :authority
	hdr = hpackIndexedName(hdr, 31, "application/connect+proto")         // content-type
	hdr = hpackNewName(hdr, "connect-protocol-version", "1")
	if token != "" {
		hdr = hpackNewName(hdr, "x-access-token", token)
	}
	env := make([]byte, 5, 5+len(body))
	binary.BigEndian.PutUint32(env[1:], uint32(len(body)))
	env = append(env, body...)

	w := bufio.NewWriter(c)
	w.WriteString("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
	writeFrame(w, h2Settings, 0, 0, nil)
	writeFrame(w, h2Headers, h2EndHeaders, 1, hdr)
	writeFrame(w, h2Data, h2EndStream, 1, env)
	if err := w.Flush(); err != nil {
		return err
	}
	r := bufio.NewReader(c)
	var head [9]byte
	var data []byte
	for {
		if _, err := io.ReadFull(r, head[:]); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
		n := int(head[0])<<16 | int(head[1])<<8 | int(head[2])
		typ, flags, stream := head[3], head[4], binary.BigEndian.Uint32(head[5:])&0x7fffffff
		if n > 1<<16 || (typ == h2Data && stream == 1 && len(data)+n > 1<<16) {
			return errors.New("warm-up: an answer larger than asked for")
		}
		payload := make([]byte, n)
		if _, err := io.ReadFull(r, payload); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
		switch {
		case typ == h2Settings && flags&h2Ack == 0:
			writeFrame(w, h2Settings, h2Ack, 0, nil)
			if err := w.Flush(); err != nil {
				return err
			}
		case typ == h2Data && stream == 1:
			data = append(data, payload...)
		case typ == h2RSTStream && stream == 1, typ == h2GoAway:
			return errors.New("warm-up: the server refused the request")
		}
		if stream == 1 && (typ == h2Data || typ == h2Headers) && flags&h2EndStream != 0 {
			return warmAnswer(data)
		}
	}
}

// warmAnswer checks that the answer is the end of a stream that says the
// empty command was refused: the request went the whole way to Start.
func warmAnswer(data []byte) error {
	for len(data) >= 5 {
		n := int(binary.BigEndian.Uint32(data[1:5]))
		if len(data) < 5+n {
			break
		}
		if data[0]&0x02 != 0 { // the Connect protocol's end of stream
			var end struct {
				Error *struct{ Code string } `json:"error"`
			}
			if err := json.Unmarshal(data[5:5+n], &end); err != nil {
				return fmt.Errorf("warm-up: %w", err)
			}
			if end.Error == nil || end.Error.Code != "invalid_argument" {
				return fmt.Errorf("warm-up: the answer is not invalid_argument: %s", data[5:5+n])
			}
			return nil
		}
		data = data[5+n:]
	}
	return errors.New("warm-up: the answer has no end of stream")
}

// HTTP/2 frame types and flags (RFC 9113, section 6).
const (
	h2Data       = 0x0
	h2Headers    = 0x1
	h2RSTStream  = 0x3
	h2Settings   = 0x4
	h2GoAway     = 0x7
	h2EndStream  = 0x1
	h2Ack        = 0x1
	h2EndHeaders = 0x4
)

func writeFrame(w *bufio.Writer, typ, flags byte, stream uint32, payload []byte) {
	var head [9]byte
	head[0], head[1], head[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	head[3], head[4] = typ, flags
	binary.BigEndian.PutUint32(head[5:], stream)
	w.Write(head[:])
	w.Write(payload)
}

// HPACK (RFC 7541) literals without indexing, strings without Huffman
// coding: all WarmUp's request needs.

func hpackIndexedName(b []byte, index int, value string) []byte {
	return hpackString(hpackInt(b, 0x00, 4, index), value)
}

func hpackNewName(b []byte, name, value string) []byte {
	return hpackString(hpackString(append(b, 0x00), name), value)
}

func hpackString(b []byte, s string) []byte {
	return append(hpackInt(b, 0x00, 7, len(s)), s...)
}

// hpackInt encodes v with an n-bit prefix after the bits in first.
func hpackInt(b []byte, first byte, n uint, v int) []byte {
	max := 1<<n - 1
	if v < max {
		return append(b, first|byte(v))
	}
	b = append(b, first|byte(max))
	for v -= max; v >= 128; v >>= 7 {
		b = append(b, byte(v&0x7f|0x80))
	}
	return append(b, byte(v))
}

// oneConn is a listener that hands out one connection, then waits until
// it is closed.
type oneConn struct {
	conn net.Conn
	once sync.Once
	done chan struct{}
	mu   sync.Mutex
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.conn
	l.conn = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConn) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *oneConn) Addr() net.Addr { return &net.UnixAddr{Net: "unix", Name: "warm-up"} }
