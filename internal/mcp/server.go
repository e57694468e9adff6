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
	// KeepAgents keeps a connection to each sandbox's agent between calls
	// (a long-lived server: cage mcp); otherwise each call closes its own.
	KeepAgents bool
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
	t := &tools{c: cfg.Client, proxyURL: cfg.ProxyURL, keep: cfg.KeepAgents}
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
	keep     bool

	mu     sync.Mutex
	agents map[string]*agentclient.Client // by sandbox id + token, when keep
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
	if !t.keep {
		ac, err := t.c.Agent(d.SandboxID, d.EnvdAccessToken)
		if err != nil {
			return nil, nil, err
		}
		return ac, ac.Close, nil
	}
	key := d.SandboxID + "/" + d.EnvdAccessToken
	t.mu.Lock()
	defer t.mu.Unlock()
	if ac, ok := t.agents[key]; ok {
		return ac, func() {}, nil
	}
	ac, err := t.c.Agent(d.SandboxID, d.EnvdAccessToken)
	if err != nil {
		return nil, nil, err
	}
	if t.agents == nil || len(t.agents) >= 64 {
		for _, old := range t.agents {
			old.Close()
		}
		t.agents = map[string]*agentclient.Client{}
	}
	t.agents[key] = ac
	return ac, func() {}, nil
}

// forget drops a kept agent client of a sandbox that is gone.
func (t *tools) forget(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, ac := range t.agents {
		if strings.HasPrefix(k, id+"/") {
			ac.Close()
			delete(t.agents, k)
		}
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
		return fmt.Errorf("the cage daemon is not running (%v): start it with cage serve", err)
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
