// Package client is how the CLI reaches a running daemon: the control API
// (E2B's REST with cage's fields, in api/types' generated types) and,
// through the daemon's proxy, a sandbox's agent. Like tailscale's CLI, the CLI never touches daemon state
// directly.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
)

// ErrNotRunning means nothing answers at the daemon's address.
var ErrNotRunning = errors.New("the daemon is not running")

// APIError is an error answer of the API.
type APIError struct {
	Status  int
	Message string
}

func (e *APIError) Error() string { return e.Message }

// Client talks to one daemon.
type Client struct {
	API   string // e.g. http://127.0.0.1:3000
	Proxy string // e.g. http://127.0.0.1:3001
	Key   string
	// HostSide marks the daemon's own client (the dashboard, /mcp): its
	// agent clients hold less unread (agentclient.NewHostSide).
	HostSide bool
	// Dial, when set, dials the proxy for Agent (the daemon's own
	// clients: connLimiter.dialOwn).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	http *http.Client
}

// New returns a client.
func New(api, proxy, key string) *Client {
	return &Client{API: strings.TrimRight(api, "/"), Proxy: strings.TrimRight(proxy, "/"), Key: key,
		http: &http.Client{Timeout: 5 * time.Minute}}
}

// UseTransport has the client's API calls go through rt (the daemon's own
// clients: a transport that dials with connLimiter.dialOwn).
func (c *Client) UseTransport(rt http.RoundTripper) { c.http.Transport = rt }

func (c *Client) do(ctx context.Context, method, path string, body, out any) (http.Header, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.API+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", c.Key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%w at %s", ErrNotRunning, c.API)
		}
		return nil, err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if resp.StatusCode >= 300 {
		var e types.Error
		if json.Unmarshal(data, &e) != nil || e.Message == "" {
			e.Message = strings.TrimSpace(string(data))
		}
		return nil, &APIError{Status: resp.StatusCode, Message: e.Message}
	}
	if out != nil && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			return nil, fmt.Errorf("decode %s %s: %w", method, path, err)
		}
	}
	return resp.Header, nil
}

// Create makes a sandbox.
func (c *Client) Create(ctx context.Context, body types.NewSandboxV2) (*types.Sandbox, error) {
	var sb types.Sandbox
	_, err := c.do(ctx, http.MethodPost, "/v2/sandboxes", body, &sb)
	return &sb, err
}

// List returns every running sandbox of the key, following pages.
func (c *Client) List(ctx context.Context, metadata map[string]string) ([]types.ListedSandbox, error) {
	return c.ListStates(ctx, nil, metadata)
}

// ListStates returns every sandbox of the key in the given states
// (running, paused; none: running), following pages.
func (c *Client) ListStates(ctx context.Context, states []string, metadata map[string]string) ([]types.ListedSandbox, error) {
	q := url.Values{"limit": {"100"}}
	if len(states) > 0 {
		q.Set("state", strings.Join(states, ","))
	}
	if len(metadata) > 0 {
		md := url.Values{}
		for k, v := range metadata {
			md.Set(k, v)
		}
		q.Set("metadata", md.Encode())
	}
	var all []types.ListedSandbox
	for {
		var page []types.ListedSandbox
		h, err := c.do(ctx, http.MethodGet, "/v2/sandboxes?"+q.Encode(), nil, &page)
		if err != nil {
			return nil, err
		}
		all = append(all, page...)
		next := h.Get("X-Next-Token")
		if next == "" {
			return all, nil
		}
		q.Set("nextToken", next)
	}
}

// Get returns one sandbox.
func (c *Client) Get(ctx context.Context, id string) (*types.SandboxDetail, error) {
	var sb types.SandboxDetail
	_, err := c.do(ctx, http.MethodGet, "/sandboxes/"+url.PathEscape(id), nil, &sb)
	return &sb, err
}

// Kill destroys a sandbox.
func (c *Client) Kill(ctx context.Context, id string) error {
	_, err := c.do(ctx, http.MethodDelete, "/sandboxes/"+url.PathEscape(id), nil, nil)
	return err
}

// Pause pauses a sandbox, keeping its memory or only its files.
func (c *Client) Pause(ctx context.Context, id string, keepMemory bool) error {
	_, err := c.do(ctx, http.MethodPost, "/sandboxes/"+url.PathEscape(id)+"/pause", types.SandboxPauseRequest{Memory: &keepMemory}, nil)
	return err
}

// Resume resumes a paused sandbox (connect: a running one is only extended)
// for timeout seconds from now.
func (c *Client) Resume(ctx context.Context, id string, timeout int64) (*types.Sandbox, error) {
	var sb types.Sandbox
	_, err := c.do(ctx, http.MethodPost, "/v2/sandboxes/"+url.PathEscape(id)+"/connect", types.ConnectSandboxV2{Timeout: &timeout}, &sb)
	return &sb, err
}

// Snapshot saves a running sandbox's files as a snapshot ("" name: none).
func (c *Client) Snapshot(ctx context.Context, id, name string) (*types.SnapshotInfo, error) {
	var sn types.SnapshotInfo
	_, err := c.do(ctx, http.MethodPost, "/sandboxes/"+url.PathEscape(id)+"/snapshots", types.SnapshotRequest{Name: name}, &sn)
	return &sn, err
}

// Fork makes count sandboxes from a running sandbox, each living
// timeout seconds: one result a fork, its sandbox or its error.
func (c *Client) Fork(ctx context.Context, id string, count, timeout int32) ([]types.SandboxForkResult, error) {
	var out []types.SandboxForkResult
	_, err := c.do(ctx, http.MethodPost, "/sandboxes/"+url.PathEscape(id)+"/fork", types.SandboxForkRequest{Count: count, Timeout: timeout}, &out)
	return out, err
}

// DeleteSnapshot deletes a snapshot by its id.
func (c *Client) DeleteSnapshot(ctx context.Context, snapshotID string) error {
	_, err := c.do(ctx, http.MethodDelete, "/templates/"+url.PathEscape(snapshotID), nil, nil)
	return err
}

// Agent returns a client of the sandbox's agent, through the daemon's proxy.
func (c *Client) Agent(id, token string) (*agentclient.Client, error) {
	u, err := url.Parse(c.Proxy)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("proxy address %q: want http://HOST:PORT", c.Proxy)
	}
	dial := func(ctx context.Context) (net.Conn, error) {
		dialContext := (&net.Dialer{}).DialContext
		if c.Dial != nil {
			dialContext = c.Dial
		}
		conn, err := dialContext(ctx, "tcp", u.Host)
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%w at %s", ErrNotRunning, c.Proxy)
		}
		return conn, err
	}
	h := http.Header{}
	h.Set("E2b-Sandbox-Id", id)
	h.Set("E2b-Sandbox-Port", "49983")
	if c.HostSide {
		return agentclient.NewHostSide(dial, token, h), nil
	}
	return agentclient.NewWithHeaders(dial, token, h), nil
}
