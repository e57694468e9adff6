package difytest

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// TestDifyWalls: runs on the OCI walls (dify.wall), with Dify's runners;
// a run that passes its time is killed there too.
func TestDifyWalls(t *testing.T) {
	for _, wall := range []string{"runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) {
			requireWall(t, wall)
			s := start(t, map[string]any{"wall": wall, "timeout": "3s"})
			py := "def main(x: int) -> dict:\n    import platform\n    return {'double': x * 2, 'python': platform.python_version()}\n"
			out, err := s.mustRun(t, "python3", pythonRunner(py, map[string]any{"x": 21}), "")
			if err != nil || result(t, out.Stdout)["double"] != float64(42) {
				t.Fatalf("python3 on %s: %v %+v", wall, err, out)
			}
			out, err = s.mustRun(t, "nodejs", nodeRunner("function main({x}) { return {double: x * 2} }", map[string]any{"x": 21}), "")
			if err != nil || result(t, out.Stdout)["double"] != float64(42) {
				t.Fatalf("nodejs on %s: %v %+v", wall, err, out)
			}
			out, err = s.mustRun(t, "python3", "while True:\n    pass\n", "")
			if err == nil || out.ExitCode != -1 || !strings.Contains(out.Error, "error: timeout") {
				t.Fatalf("a run past its time on %s: %v %+v", wall, err, out)
			}
			s.testNothingLeft(t)
		})
	}
}

// requireWall skips (or, where CAGE_REQUIRE_WALLS names the wall, fails) a
// test of a wall whose runtime this machine lacks.
func requireWall(t *testing.T, wall string) {
	t.Helper()
	if p := os.Getenv("CAGE_RUNSC"); wall == "gvisor" && p != "" {
		if _, err := os.Stat(p); err == nil {
			return
		}
	}
	bin := map[string]string{"runc": "runc", "gvisor": "runsc"}[wall]
	if _, err := exec.LookPath(bin); err != nil {
		testutil.SkipWall(t, wall, "%s is not installed", bin)
	}
}

// TestDifyConfigRefused: a Dify listener without its key, or with a
// config the service cannot keep, stops cage serve at its start with
// one line saying what to set.
func TestDifyConfigRefused(t *testing.T) {
	testutil.RequireRoot(t)
	cage := filepath.Join(testutil.Binaries(t), "cage")
	for _, c := range []struct {
		dify map[string]any
		want string
	}{
		{map[string]any{}, "cage: dify.key (or CAGE_DIFY_KEY) is required"},
		{map[string]any{"key": "k", "timeout": "2h"}, "cage: dify: timeout 2h0m0s: want 1s to 1h"},
		{map[string]any{"key": "k", "max_workers": 10, "max_requests": 5}, "cage: dify: want 1 <= max_workers (10) <= max_requests (5)"},
		{map[string]any{"key": "k", "wall": "wood"}, `cage: dify.wall: invalid: unknown wall "wood"`},
	} {
		cfg, _ := json.Marshal(map[string]any{"dify": c.dify})
		path := filepath.Join(t.TempDir(), "cage.json")
		if err := os.WriteFile(path, cfg, 0o600); err != nil {
			t.Fatal(err)
		}
		runDir := testutil.RunDir(t)
		cmd := exec.Command(cage, "--run-dir", runDir, "serve", "--data", t.TempDir(), "--api", freeAddr(t), "--proxy", freeAddr(t),
			"--pool", "0", "--dify", freeAddr(t), "--config", path)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		done := make(chan error, 1)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(stderr.String(), c.want) {
				t.Errorf("dify %v: %v, stderr:\n%s\nwant a refusal with %q", c.dify, err, stderr.String(), c.want)
			}
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("dify %v: cage serve started", c.dify)
		}
	}
}
