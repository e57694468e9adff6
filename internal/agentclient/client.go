// Package agentclient is the host's client of a sandbox's agent: Connect RPC
// over whatever connection the sandbox's wall supplies (Dial), with the
// sandbox's access token on every request.
package agentclient

import (
	"context"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// DialFunc opens a connection to the agent.
type DialFunc func(ctx context.Context) (net.Conn, error)

// BaseURL is the URL the client uses; the host part is ignored by Dial.
const BaseURL = "http://agent"

// Client talks to one sandbox's agent.
type Client struct {
	Process processconnect.ProcessClient
	FS      filesystemconnect.FilesystemClient
	HTTP    *http.Client // for /files, /envs, /health; adds the token
	h2      *http.Transport
}

// New builds a client of an agent on this host. All RPCs share one HTTP/2
// (h2c) connection, which also carries client streams (StreamInput). It
// does not ask for compressed responses: over a local socket gzip saves no
// time, and a fresh agent's first compressor costs it about a megabyte of
// memory to fault in and a millisecond of CPU per sandbox.
func New(dial DialFunc, token string) *Client {
	return newClient(dial, token, nil, true, true)
}

// NewWithHeaders is a client through the daemon's proxy, with headers added
// to every request (the proxy routes by E2b-Sandbox-Id). The proxy may be
// across a network, so it accepts gzip-compressed responses (the agent
// compresses only messages worth it).
func NewWithHeaders(dial DialFunc, token string, headers http.Header) *Client {
	return newClient(dial, token, headers, false, false)
}

// NewHostSide is NewWithHeaders for the daemon's own clients through its
// proxy (the dashboard's terminals and files, /mcp): what each stream and
// connection may hold unread is bounded as for New's (see
// maxStreamWindow), where a client across a network (the CLI) keeps
// net/http's larger windows, which its throughput needs.
func NewHostSide(dial DialFunc, token string, headers http.Header) *Client {
	return newClient(dial, token, headers, false, true)
}

func newClient(dial DialFunc, token string, headers http.Header, local, bounded bool) *Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols: &p,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		},
		IdleConnTimeout: 90 * time.Second,
		// Nor does net/http ask for gzip on a local client's behalf.
		DisableCompression: local,
		// The agent is not trusted: its answers' heads and messages are
		// bounded (net/http's default allows 10 MiB of headers, Connect
		// 4 GiB messages).
		MaxResponseHeaderBytes: 64 << 10,
	}
	if bounded {
		// What the agent (or the proxy) may send ahead of what the host
		// reads: net/http's client lets a stream hold 4 MiB and a
		// connection 1 GiB. A reader that stops (the dashboard's
		// terminal, whose browser reads nothing, for its write's 30 s;
		// a hostile agent pushing on a stream the host no longer reads)
		// held 4 MiB of the daemon's heap a stream, 7.5 MiB of its RSS,
		// and a key's 512 terminals some 4 GiB (found by review,
		// 2026-12-04).
		tr.HTTP2 = &http.HTTP2Config{MaxReceiveBufferPerStream: maxStreamWindow, MaxReceiveBufferPerConnection: maxConnWindow}
	}
	opts := []connect.ClientOption{connect.WithReadMaxBytes(maxMessage), connect.WithCodec(boundedCodec{})}
	if local {
		opts = append(opts, connect.WithAcceptCompression("gzip", nil, nil))
	}
	hc := &http.Client{Transport: tokenTransport{token: token, headers: headers, next: tr}}
	return &Client{
		Process: processconnect.NewProcessClient(hc, BaseURL, opts...),
		FS:      filesystemconnect.NewFilesystemClient(hc, BaseURL, opts...),
		HTTP:    hc,
		h2:      tr,
	}
}

// maxStreamWindow and maxConnWindow bound the HTTP/2 flow-control
// windows the client grants: the bytes a stream, and all a connection's
// streams, may have sent to it unread.
const (
	maxStreamWindow = 256 << 10
	maxConnWindow   = 1 << 20
)

// maxMessage bounds one message from the agent (and what it inflates
// to). An honest agent's are small (32 KiB of output, an entry, a list of
// the processes it started) but for a directory's listing, which ListDir
// reads as it comes, bounded by what it keeps; the items a message
// decodes to are bounded too (boundedCodec).
const maxMessage = 4 << 20

// Close drops the client's connections.
func (c *Client) Close() { c.h2.CloseIdleConnections() }

type tokenTransport struct {
	token   string
	headers http.Header
	next    http.RoundTripper
}

func (t tokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if t.token != "" || len(t.headers) > 0 {
		r = r.Clone(r.Context())
		if t.token != "" {
			r.Header.Set("X-Access-Token", t.token)
		}
		for k, v := range t.headers {
			r.Header[k] = v
		}
	}
	resp, err := t.next.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	return guardAnswer(resp)
}
