package agentclient

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ErrPortClosed is DialPort's error when nothing listens on the port.
var ErrPortClosed = errors.New("port is not open in the sandbox")

// DialPort opens a connection to a port inside the sandbox through its agent
// (a CONNECT the agent answers by connecting to the port on the sandbox's
// own loopback). The connection then carries the port's bytes as they are.
func DialPort(ctx context.Context, dial DialFunc, token string, port int) (net.Conn, error) {
	c, err := dial(ctx)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	} else {
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	}
	target := net.JoinHostPort("localhost", strconv.Itoa(port))
	req := fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: %s\r\nX-Access-Token: %s\r\n\r\n", target, target, token)
	if _, err := io.WriteString(c, req); err != nil {
		c.Close()
		return nil, err
	}
	// The agent is not trusted: its answer's head is read within
	// maxAnswerHead (http.ReadResponse has no bound of its own), then
	// the connection carries the port's bytes without one.
	lr := &headLimit{r: c, left: maxAnswerHead}
	br := bufio.NewReader(lr)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("port %d: %w", port, err)
	}
	lr.left = -1
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		c.Close()
		if resp.StatusCode == http.StatusBadGateway {
			return nil, fmt.Errorf("%w (port %d)", ErrPortClosed, port)
		}
		return nil, fmt.Errorf("port %d: the agent answered %s: %s", port, resp.Status, strings.TrimSpace(string(body)))
	}
	_ = c.SetDeadline(time.Time{})
	return &bufferedConn{Conn: c, r: br}, nil
}

// maxAnswerHead bounds the agent's answer to a CONNECT up to its body.
const maxAnswerHead = 16 << 10

// headLimit reads r until left bytes are read, then fails; left < 0: no
// limit.
type headLimit struct {
	r    io.Reader
	left int64
}

func (h *headLimit) Read(p []byte) (int, error) {
	if h.left < 0 {
		return h.r.Read(p)
	}
	if h.left == 0 {
		return 0, errors.New("the agent's answer is too long")
	}
	if int64(len(p)) > h.left {
		p = p[:h.left]
	}
	n, err := h.r.Read(p)
	h.left -= int64(n)
	return n, err
}

// bufferedConn reads what the reader holds before the connection.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// CloseWrite half-closes when the connection can.
func (b *bufferedConn) CloseWrite() error {
	if cw, ok := b.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return b.Conn.Close()
}
