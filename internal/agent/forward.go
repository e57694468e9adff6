package agent

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// A server listening inside the sandbox is reached from outside through the
// agent: the host sends "CONNECT localhost:PORT" with the access token, the
// agent connects to the port on the sandbox's own loopback (IPv4, then
// IPv6) and, once connected, pipes bytes both ways. This works on every wall
// and in every network mode, also for servers bound to localhost only, and
// opens nothing in the sandbox's network.

// ForwardHost is the only host a CONNECT may name.
const ForwardHost = "localhost"

// serveForward handles a CONNECT.
func (s *Server) serveForward(w http.ResponseWriter, r *http.Request) {
	if !s.tokenOK(r.Header) {
		http.Error(w, "missing or invalid access token", http.StatusUnauthorized)
		return
	}
	host, portStr, err := net.SplitHostPort(r.Host)
	port, perr := strconv.Atoi(portStr)
	if err != nil || host != ForwardHost || perr != nil || port < 1 || port > 65535 {
		http.Error(w, fmt.Sprintf("CONNECT %s: want %s:PORT", r.Host, ForwardHost), http.StatusBadRequest)
		return
	}
	target, err := dialLocal(port)
	if err != nil {
		http.Error(w, fmt.Sprintf("port %d is not open in the sandbox", port), http.StatusBadGateway)
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		target.Close()
		http.Error(w, "CONNECT needs HTTP/1.1", http.StatusHTTPVersionNotSupported)
		return
	}
	conn, buf, err := hj.Hijack()
	if err != nil {
		target.Close()
		return
	}
	if _, err := conn.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		conn.Close()
		target.Close()
		return
	}
	// What the client sent after the CONNECT, already read, goes first.
	if n := buf.Reader.Buffered(); n > 0 {
		b, _ := buf.Reader.Peek(n)
		if _, err := target.Write(b); err != nil {
			conn.Close()
			target.Close()
			return
		}
	}
	pipe(conn, target)
}

func dialLocal(port int) (net.Conn, error) {
	var first error
	for _, a := range []string{"127.0.0.1", "::1"} {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(a, strconv.Itoa(port)), 5*time.Second)
		if err == nil {
			return c, nil
		}
		if first == nil {
			first = err
		}
	}
	return nil, first
}

// pipe copies both ways until both directions end, half-closing as each does.
func pipe(a, b net.Conn) {
	var wg sync.WaitGroup
	cp := func(dst, src net.Conn) {
		defer wg.Done()
		_, _ = io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			_ = dst.Close()
		}
	}
	wg.Add(2)
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
	a.Close()
	b.Close()
}
