package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/bench/stats"
)

// MCPExecFigures are exec round trips in one sandbox, interleaved: the
// exec tool over MCP's stdio (`cage mcp`) and streamable HTTP (/mcp), and
// the same command through the E2B protocol (the agent's Start through the
// proxy, as an E2B SDK's commands.run sends it: /bin/bash -l -c CMD).
type MCPExecFigures struct {
	Stdio, HTTP, E2B stats.Stats
}

// MCPExec measures MCPExecFigures with `true` as the command, runs times
// each after a warm-up, against a daemon this benchmark started; exe is
// the cage binary (cage mcp).
func MCPExec(ctx context.Context, exe string, d *Daemon, runs int) (MCPExecFigures, error) {
	var f MCPExecFigures
	c := d.Client()
	sb, err := c.Create(ctx, hostSandbox(600))
	if err != nil {
		return f, err
	}
	defer c.Kill(context.Background(), sb.SandboxID)
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		return f, err
	}
	defer ac.Close()

	cmd := exec.Command(exe, "mcp")
	cmd.Env = append(os.Environ(), "CAGE_HOST="+d.API, "CAGE_PROXY_URL="+d.Proxy, "CAGE_API_KEY="+d.Key)
	cmd.Stderr = io.Discard
	client := sdk.NewClient(&sdk.Implementation{Name: "cage-bench", Version: "1"}, nil)
	stdio, err := client.Connect(ctx, &sdk.CommandTransport{Command: cmd}, nil)
	if err != nil {
		return f, fmt.Errorf("cage mcp: %w", err)
	}
	defer stdio.Close()
	hc := &http.Client{Transport: keyTransport{key: d.Key, next: http.DefaultTransport}}
	web, err := client.Connect(ctx, &sdk.StreamableClientTransport{Endpoint: d.API + "/mcp", HTTPClient: hc, DisableStandaloneSSE: true}, nil)
	if err != nil {
		return f, fmt.Errorf("/mcp: %w", err)
	}
	defer web.Close()

	tool := func(s *sdk.ClientSession) func() error {
		return func() error { return mcpExec(ctx, s, sb.SandboxID) }
	}
	peer := func() error {
		end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/bash", Args: []string{"-l", "-c", "true"}, Stdout: io.Discard, Stderr: io.Discard})
		if err == nil && end.GetExitCode() != 0 {
			err = fmt.Errorf("exit code %d", end.GetExitCode())
		}
		return err
	}
	fns := []func() error{tool(stdio), tool(web), peer}
	samples := make([][]time.Duration, len(fns))
	for i := -5; i < runs; i++ { // interleaved: drift hits all alike
		for k, fn := range fns {
			start := time.Now()
			if err := fn(); err != nil {
				return f, err
			}
			if i >= 0 {
				samples[k] = append(samples[k], time.Since(start))
			}
		}
	}
	return MCPExecFigures{Stdio: stats.Summarize(samples[0]), HTTP: stats.Summarize(samples[1]), E2B: stats.Summarize(samples[2])}, nil
}

func mcpExec(ctx context.Context, s *sdk.ClientSession, id string) error {
	r, err := s.CallTool(ctx, &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"sandbox_id": id, "command": "true"}})
	if err != nil {
		return err
	}
	if r.IsError {
		for _, c := range r.Content {
			if t, ok := c.(*sdk.TextContent); ok {
				return errors.New(t.Text)
			}
		}
		return errors.New("exec: a tool error")
	}
	return nil
}

// keyTransport sends the API key as a bearer token.
type keyTransport struct {
	key  string
	next http.RoundTripper
}

func (t keyTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+t.key)
	return t.next.RoundTrip(r)
}
