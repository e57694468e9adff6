package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/wall"
)

// E2B's network.httpsPorts: a server inside the sandbox that speaks TLS
// on one of these ports is reached over TLS, its certificate not verified
// (the sandbox made it; see docs/SECURITY.md), with the request's host as
// the server name. The client side is the proxy's own HTTP or TLS, so a
// client reaches such a server as it reaches any other port.

// upstream is the scheme and pool key of a request to a port: a TLS
// port's key also names the server name sent, so a pooled connection is
// reused only for the same name.
func upstream(a Access, port int, host string) (scheme, key string) {
	if !slices.Contains(a.HTTPSPorts, port) {
		return "http", poolKey(port)
	}
	if name := serverName(host); name != "" {
		return "https", poolKey(port) + "." + name
	}
	return "https", poolKey(port)
}

// serverName is the name a TLS port is sent (SNI): the request's host less
// its port, when that is a DNS name; "" otherwise (an IP address or
// anything odd sends none).
func serverName(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if host == "" || len(host) > 253 || net.ParseIP(host) != nil {
		return ""
	}
	for _, label := range strings.Split(host, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return ""
		}
		for i := 0; i < len(label); i++ {
			if c := label[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
				return ""
			}
		}
	}
	return host
}

// tlsKey reads a TLS pool key "port-N[.name]:443" back into its port and
// server name.
func tlsKey(addr string) (port int, name string, err error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, "", err
	}
	p, name, _ := strings.Cut(strings.TrimPrefix(host, "port-"), ".")
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 || !strings.HasPrefix(host, "port-") {
		return 0, "", fmt.Errorf("proxy: bad pool key %q", addr)
	}
	return n, name, nil
}

// dialTLS dials a TLS port of a sandbox through the agent's port forward
// and makes the TLS handshake: HTTP/1.1 only (WebSockets upgrade on it),
// the sandbox's own certificate taken as it is.
func dialTLS(sb wall.Sandbox) func(ctx context.Context, _, addr string) (net.Conn, error) {
	return func(ctx context.Context, _, addr string) (net.Conn, error) {
		port, name, err := tlsKey(addr)
		if err != nil {
			return nil, err
		}
		if port == EnvdPort {
			return nil, fmt.Errorf("proxy: port %d is never TLS", port)
		}
		raw, err := agentclient.DialPort(ctx, sb.Dial, sb.Token(), port)
		if err != nil {
			return nil, err
		}
		conn := tls.Client(raw, &tls.Config{
			ServerName: name,
			// The sandbox's certificate is its own, self-made; the hop
			// runs host to sandbox through the agent, never a network.
			InsecureSkipVerify: true, //nolint:gosec // see docs/SECURITY.md
			NextProtos:         []string{"http/1.1"},
			MinVersion:         tls.VersionTLS12,
		})
		hctx, cancel := context.WithTimeout(ctx, tlsHandshakeTimeout)
		defer cancel()
		if err := conn.HandshakeContext(hctx); err != nil {
			raw.Close()
			return nil, fmt.Errorf("%w: TLS handshake with port %d: %v", errTLSPort, port, err)
		}
		return conn, nil
	}
}

// tlsHandshakeTimeout bounds a TLS port's handshake: a server that never
// finishes one holds a connection no longer than this.
const tlsHandshakeTimeout = 30 * time.Second

// errTLSPort is a TLS port whose server did not make a TLS handshake.
var errTLSPort = errors.New("the port's server did not speak TLS")

// tlsMismatch is what a client is told when the port's server may not
// speak the protocol the sandbox named: a TLS port that did not make a TLS
// handshake, or a plain port whose server closed the connection without a
// word or answered with a TLS record (as a TLS server does to plain HTTP);
// "" for any other error.
func tlsMismatch(err error) string {
	switch {
	case errors.Is(err, errTLSPort):
		return "The sandbox's port is in network.httpsPorts but its server did not speak TLS"
	case errors.Is(err, io.EOF), strings.Contains(err.Error(), `malformed HTTP response "\x15\x03`),
		strings.Contains(err.Error(), `malformed HTTP response "\x16\x03`):
		return "The sandbox's port closed the connection without an HTTP answer; if its server speaks TLS, list the port in network.httpsPorts"
	}
	return ""
}
