package cli

import (
	"bytes"
	"strings"
	"testing"
)

// TestMCPNoKey: cage mcp without a key is a usage error of one line, and
// writes nothing on stdout (which is the MCP client's).
func TestMCPNoKey(t *testing.T) {
	t.Setenv("CAGE_API_KEY", "")
	t.Setenv("E2B_API_KEY", "")
	var out, errOut bytes.Buffer
	code := Main([]string{"mcp"}, &out, &errOut)
	if code != ExitUsage || out.Len() != 0 || strings.Count(errOut.String(), "\n") != 1 || !strings.Contains(errOut.String(), "CAGE_API_KEY") {
		t.Errorf("cage mcp without a key: exit %d, stdout %q, stderr %q; want %d, nothing, one line naming CAGE_API_KEY", code, out.String(), errOut.String(), ExitUsage)
	}
}

// TestFirstEnv: CAGE_ variables win over E2B's, which win over the default.
func TestFirstEnv(t *testing.T) {
	t.Setenv("CAGE_HOST", "")
	t.Setenv("E2B_API_URL", "http://e2b")
	if got := firstEnv("def", "CAGE_HOST", "E2B_API_URL"); got != "http://e2b" {
		t.Errorf("got %q", got)
	}
	t.Setenv("CAGE_HOST", "http://cage")
	if got := firstEnv("def", "CAGE_HOST", "E2B_API_URL"); got != "http://cage" {
		t.Errorf("got %q", got)
	}
}
