package cli

import (
	"context"
	"errors"
	"io"
	"os"
	"os/signal"
	"syscall"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/mcp"
)

// firstEnv is the first of the variables that is set, else def.
func firstEnv(def string, keys ...string) string {
	for _, k := range keys {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return def
}

func newMCPCmd() *cobra.Command {
	var host, proxy, key string
	cmd := &cobra.Command{
		Use:   "mcp",
		Short: "Serve cage's sandboxes as MCP tools over stdio (for Claude Desktop, Cursor, VS Code)",
		Long: `Serve cage's sandboxes as MCP tools on standard input and output, for an MCP
client that starts it (Claude Desktop, Cursor, VS Code, agent frameworks). It is a
client of a running cage serve: every tool acts with the API key's rights.
The daemon also serves the same tools over streamable HTTP at /mcp on its API address.

Tools: ` + joinNames() + `.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if key == "" {
				return exitf(ExitUsage, "no API key: set CAGE_API_KEY (or E2B_API_KEY) or pass --key (create one with `cage keys create`)")
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			s := mcp.NewServer(mcp.Config{Client: client.New(host, proxy, key), Agents: mcp.NewAgents()})
			err := s.Run(ctx, &sdk.IOTransport{Reader: readCloser{cmd.InOrStdin()}, Writer: writeCloser{cmd.OutOrStdout()}})
			if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, io.EOF) {
				return nil
			}
			return exitf(ExitInternal, "mcp: %v", err)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&host, "host", firstEnv("http://127.0.0.1:3000", "CAGE_HOST", "E2B_API_URL"), "the daemon's control API ($CAGE_HOST, $E2B_API_URL)")
	fl.StringVar(&proxy, "proxy-url", firstEnv("http://127.0.0.1:3001", "CAGE_PROXY_URL", "E2B_SANDBOX_URL"), "the daemon's sandbox proxy ($CAGE_PROXY_URL, $E2B_SANDBOX_URL)")
	fl.StringVar(&key, "key", firstEnv("", "CAGE_API_KEY", "E2B_API_KEY"), "API key ($CAGE_API_KEY, $E2B_API_KEY)")
	return cmd
}

func joinNames() string {
	s := ""
	for i, n := range mcp.ToolNames {
		if i > 0 {
			s += ", "
		}
		s += n
	}
	return s
}

// readCloser and writeCloser let the command's streams (os.Stdin and
// os.Stdout, or a test's buffers) be the transport's.
type readCloser struct{ io.Reader }

func (readCloser) Close() error { return nil }

type writeCloser struct{ io.Writer }

func (writeCloser) Close() error { return nil }
