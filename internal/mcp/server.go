package mcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime/debug"
	"strings"
	"sync"

	"connectrpc.com/connect"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/client"
)

// Name is the server's name in the MCP handshake.
const Name = "cage"

// Config is one server: whose sandboxes it reaches, and how.
type Config struct {
	// Client reaches the daemon's API and proxy with one API key; every
	// tool acts with that key's rights and no others.
	Client *client.Client
	// ProxyURL is the proxy as the MCP client's side reaches it, for
	// port_url ("": Client.Proxy).
	ProxyURL string
	// Agents, when set, keeps connections to sandboxes' agents between
	// calls, shared by every server holding it; otherwise each call opens
	// and closes its own.
	Agents *Agents
	// Schemas, shared by servers made one per request, keeps the tools'
	// resolved schemas.
	Schemas *sdk.SchemaCache
}

const instructions = `cage runs disposable sandboxes: isolated Linux machines for running code.
Create one with sandbox_create (it lives timeout_s seconds, 300 by default), then run shell commands with exec,
Python (or JavaScript, R, bash) with run_code (template code-interpreter-v1), and move files with file_read,
file_write and file_list. port_url gives the URL of a server listening inside. Kill sandboxes you are done with.`

// NewServer returns an MCP server with cage's tools.
func NewServer(cfg Config) *sdk.Server {
	s := sdk.NewServer(&sdk.Implementation{Name: Name, Title: "cage sandboxes", Version: version()},
		&sdk.ServerOptions{Instructions: instructions, SchemaCache: cfg.Schemas})
	t := &tools{c: cfg.Client, proxyURL: cfg.ProxyURL, agents: cfg.Agents}
	if t.proxyURL == "" {
		t.proxyURL = cfg.Client.Proxy
	}
	t.register(s)
	return s
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// tools holds what every tool handler needs.
type tools struct {
	c        *client.Client
	proxyURL string
	agents   *Agents
}

// Agents are clients of sandboxes' agents kept between tool calls, by
// sandbox id and access token: a server uses one only after the API told
// it, for its key, that the sandbox has that token, so servers of
// different keys may share them.
type Agents struct {
	mu sync.Mutex
	m  map[string]*agentclient.Client
}

// NewAgents returns an empty set of kept agent clients.
func NewAgents() *Agents { return &Agents{m: map[string]*agentclient.Client{}} }

// maxAgents bounds the clients kept; past it they are all let go (closing
// a client drops only its idle connections: calls in flight finish).
const maxAgents = 64

func (a *Agents) get(c *client.Client, d *types.SandboxDetail) (*agentclient.Client, error) {
	key := d.SandboxID + "/" + d.EnvdAccessToken
	a.mu.Lock()
	defer a.mu.Unlock()
	if ac, ok := a.m[key]; ok {
		return ac, nil
	}
	ac, err := c.Agent(d.SandboxID, d.EnvdAccessToken)
	if err != nil {
		return nil, err
	}
	if len(a.m) >= maxAgents {
		a.closeLocked()
	}
	a.m[key] = ac
	return ac, nil
}

// forget drops the clients of a sandbox that is gone.
func (a *Agents) forget(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for k, ac := range a.m {
		if strings.HasPrefix(k, id+"/") {
			ac.Close()
			delete(a.m, k)
		}
	}
}

// Close drops every kept client's connections.
func (a *Agents) Close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closeLocked()
}

func (a *Agents) closeLocked() {
	for k, ac := range a.m {
		ac.Close()
		delete(a.m, k)
	}
}

// sandbox is a running sandbox reached through the proxy.
type sandbox struct {
	*types.SandboxDetail
	agent   *agentclient.Client
	release func()
}

// reach looks a sandbox up with the key (another key's is not found) and
// returns its agent's client; release must be called when done.
func (t *tools) reach(ctx context.Context, id string) (*sandbox, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	d, err := t.c.Get(ctx, id)
	if err != nil {
		return nil, t.failure(err)
	}
	if d.State == "paused" {
		return nil, fmt.Errorf("sandbox %s is paused: resume it with sandbox_resume first", id)
	}
	ac, release, err := t.agent(d)
	if err != nil {
		return nil, err
	}
	return &sandbox{SandboxDetail: d, agent: ac, release: release}, nil
}

func (t *tools) agent(d *types.SandboxDetail) (*agentclient.Client, func(), error) {
	if t.agents != nil {
		ac, err := t.agents.get(t.c, d)
		return ac, func() {}, err
	}
	ac, err := t.c.Agent(d.SandboxID, d.EnvdAccessToken)
	if err != nil {
		return nil, nil, err
	}
	return ac, ac.Close, nil
}

// forget drops the kept agent clients of a sandbox that is gone.
func (t *tools) forget(id string) {
	if t.agents != nil {
		t.agents.forget(id)
	}
}

// failure is the one line a model reads for a failure of the API, the
// proxy or an agent. The API's 404 is the same for another key's sandbox
// as for one that never existed, and so is this.
func (t *tools) failure(err error) error {
	var ae *client.APIError
	var ce *connect.Error
	switch {
	case errors.Is(err, client.ErrNotRunning):
		return fmt.Errorf("%v: start it with cage serve (or point CAGE_HOST at it)", err)
	case errors.As(err, &ae):
		switch ae.Status {
		case http.StatusUnauthorized:
			return fmt.Errorf("the daemon refused the API key: %s", ae.Message)
		case http.StatusTooManyRequests:
			return fmt.Errorf("%s (the daemon is at a limit: try again shortly)", ae.Message)
		}
		return errors.New(ae.Message)
	case errors.As(err, &ce):
		if ce.Code() == connect.CodeUnauthenticated {
			return errors.New("the sandbox's agent refused the request (the sandbox may have ended)")
		}
		return errors.New(ce.Message())
	case errors.Is(err, context.DeadlineExceeded):
		return errors.New("timed out")
	}
	return err
}
