package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// TestMCP runs mcp.test.mjs: the real MCP client from npm
// (@modelcontextprotocol/sdk 1.32.2) against cage's MCP server, over stdio
// (it spawns `cage mcp`, the key in E2B_API_KEY) and over streamable HTTP
// (/mcp on the daemon's API address, the key as a bearer token): the tools
// listed, create, exec, files, run_code's images (code-interpreter-v1, a
// pool of one started), a port's URL fetched through the proxy, pause and
// resume, kill, huge outputs, a wrong key, another key's sandbox, a key in
// the URL, a body sent before the key is checked, and paths that reach for
// the host (a file this test plants on the host must stay out of reach).
func TestMCP(t *testing.T) {
	interp, why := codeInterpreterPresent(t)
	var extra []string
	if interp {
		extra = []string{"--pool-of", "code-interpreter-v1=1"}
	}
	d := startDaemon(t, extra...)
	other := d.newKey(t)
	secretDir := t.TempDir()
	secret := filepath.Join(secretDir, "host-secret.txt")
	marker := make([]byte, 16)
	_, _ = rand.Read(marker)
	if err := os.WriteFile(secret, []byte("host secret "+hex.EncodeToString(marker)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := append(d.sdkEnv("e2b", d.key),
		"CAGE_BIN="+filepath.Join(testutil.Binaries(t), "cage"),
		"CAGE_TEST_OTHER_KEY="+other,
		"CAGE_TEST_HOST_SECRET="+secret,
		"CAGE_TEST_NO_INTERP="+why)
	if interp {
		env = append(env, "CAGE_TEST_INTERP=1")
	}
	args := []string{"--test", "--test-reporter=spec", "mcp.test.mjs"}
	if err := runNode(t, sdkDir(t), env, 8*time.Minute, args...); err != nil {
		t.Errorf("the MCP client against cage's MCP server failed: %v (the daemon's log follows the test)", err)
	}
	entries, _ := os.ReadDir(secretDir)
	if len(entries) != 1 {
		t.Errorf("the host directory of the planted secret holds %d entries after the suite, want only the secret: a tool wrote on the host", len(entries))
	}
	d.checkNoSandboxesLeft(t)
	d.stop(t)
}

// codeInterpreterPresent says whether the shared template store has
// code-interpreter-v1, else why not; where scripts/test.sh built it
// (CAGE_REQUIRE_CODE_INTERPRETER) its absence fails the test.
func codeInterpreterPresent(t *testing.T) (bool, string) {
	t.Helper()
	dir := os.Getenv("CAGE_TEMPLATES")
	if dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "templates", "code-interpreter-v1.json")); err == nil {
			return true, ""
		}
	}
	if os.Getenv("CAGE_REQUIRE_CODE_INTERPRETER") != "" {
		t.Fatalf("CAGE_REQUIRE_CODE_INTERPRETER is set but the template store %q has no code-interpreter-v1 (make code-interpreter)", dir)
	}
	return false, "the template store (CAGE_TEMPLATES=" + dir + ") has no code-interpreter-v1: make code-interpreter builds it"
}

// newKey makes one more API key in the daemon's store.
func (d *daemon) newKey(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(testutil.Binaries(t), "cage")
	out, err := cageCommand(context.Background(), bin, "keys", "create", "--data", d.data, "--name", "other").Output()
	if err != nil {
		t.Fatalf("cage keys create (a second key): %v\n%s", err, out)
	}
	key := lastLine(string(out))
	if !keyRE.MatchString(key) {
		t.Fatalf("cage keys create: %q is not a key", key)
	}
	return key
}
