package e2b

import (
	"testing"
	"time"
)

// parityWalls are the walls parity.test.mjs runs on besides the process
// wall. The microvm wall is not among them: its guest kernel (6.1) keeps no
// user extended attributes on the tmpfs that holds a sandbox's writes, so
// file metadata is refused there (501), as docs/E2B-COMPATIBILITY.md says.
var parityWalls = []string{"runc", "gvisor"}

// TestE2BParity runs parity.test.mjs (issue 15: Sandbox.list's order,
// startedAfter and template; file metadata; files.remove of a missing path;
// signed file URLs used without the token; metrics right after create; the
// base template's tools and sudo) with both SDK releases on the process
// wall, and with 2.51.0 on the other walls.
func TestE2BParity(t *testing.T) {
	t.Run("process", func(t *testing.T) {
		d := startDaemon(t)
		dir := sdkDir(t)
		for _, mod := range sdkModules {
			t.Run(mod, func(t *testing.T) {
				args := []string{"--test", "--test-reporter=spec", "parity.test.mjs"}
				if err := runNode(t, dir, d.sdkEnv(mod, d.key), 10*time.Minute, args...); err != nil {
					t.Errorf("E2B SDK %s parity suite failed: %v (the daemon's log follows the test)", mod, err)
				}
			})
		}
		d.checkNoSandboxesLeft(t)
		d.stop(t)
	})
	for _, wall := range parityWalls {
		t.Run(wall, func(t *testing.T) {
			requireWall(t, wall)
			d := startDaemon(t, "--wall", wall)
			args := []string{"--test", "--test-reporter=spec", "parity.test.mjs"}
			if err := runNode(t, sdkDir(t), d.sdkEnv("e2b", d.key), 10*time.Minute, args...); err != nil {
				t.Errorf("E2B SDK parity suite on the %s wall failed: %v (the daemon's log follows the test)", wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}
