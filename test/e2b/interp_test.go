package e2b

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestCodeInterpreter runs interp.test.mjs, the real @e2b/code-interpreter
// 2.8.0 against sandboxes of code-interpreter-v1 (scripts/test.sh builds
// it): on the process wall with a pool of started sandboxes (the pool's
// own test checks a create is served by one), and on runc and gVisor
// without a pool (every create starts its kernel). The microvm wall is not
// run: under TCG a 2 GiB template's Python kernel takes minutes to start.
func TestCodeInterpreter(t *testing.T) {
	requireCodeInterpreter(t)
	for _, c := range []struct {
		wall  string
		extra []string
	}{
		{"process", []string{"--pool-of", "code-interpreter-v1=2"}},
		{"runc", nil},
		{"gvisor", nil},
	} {
		t.Run(c.wall, func(t *testing.T) {
			if c.wall != "process" {
				requireWall(t, c.wall)
			}
			d := startDaemon(t, append([]string{"--wall", c.wall}, c.extra...)...)
			env := append(d.sdkEnv("e2b", d.key), "CAGE_TEST_WALL="+c.wall)
			if len(c.extra) > 0 {
				env = append(env, "CAGE_TEST_POOLED=1")
			}
			args := []string{"--test", "--test-reporter=spec", "interp.test.mjs"}
			if err := runNode(t, sdkDir(t), env, 15*time.Minute, args...); err != nil {
				t.Errorf("@e2b/code-interpreter on the %s wall failed: %v (the daemon's log follows the test)", c.wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}

// requireCodeInterpreter skips unless the shared template store has
// code-interpreter-v1; where scripts/test.sh built it
// (CAGE_REQUIRE_CODE_INTERPRETER) its absence fails.
func requireCodeInterpreter(t *testing.T) {
	t.Helper()
	dir := os.Getenv("CAGE_TEMPLATES")
	if dir != "" {
		if _, err := os.Stat(filepath.Join(dir, "templates", "code-interpreter-v1.json")); err == nil {
			return
		}
	}
	if os.Getenv("CAGE_REQUIRE_CODE_INTERPRETER") != "" {
		t.Fatalf("CAGE_REQUIRE_CODE_INTERPRETER is set but the template store %q has no code-interpreter-v1 (make code-interpreter)", dir)
	}
	t.Skipf("SKIP: the template store (CAGE_TEMPLATES=%q) has no code-interpreter-v1: make code-interpreter builds it", dir)
}
