// Package agentclient is the host's client of a sandbox's agent: Connect RPC
// over whatever connection the sandbox's wall supplies (Dial), with the
// sandbox's access token on every request.
package agentclient

import (
	"context"
	"net"
	"net/http"
	"time"

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

// New builds a client. All RPCs share one HTTP/2 (h2c) connection, which
// also carries client streams (StreamInput).
func New(dial DialFunc, token string) *Client {
	return NewWithHeaders(dial, token, nil)
}

// NewWithHeaders is New with headers added to every request (the daemon's
// proxy routes by E2b-Sandbox-Id).
func NewWithHeaders(dial DialFunc, token string, headers http.Header) *Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols: &p,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		},
		IdleConnTimeout: 90 * time.Second,
	}
	hc := &http.Client{Transport: tokenTransport{token: token, headers: headers, next: tr}}
	return &Client{
		Process: processconnect.NewProcessClient(hc, BaseURL),
		FS:      filesystemconnect.NewFilesystemClient(hc, BaseURL),
		HTTP:    hc,
		h2:      tr,
	}
}

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
	return t.next.RoundTrip(r)
}
