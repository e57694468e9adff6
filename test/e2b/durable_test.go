package e2b

import (
	"testing"
	"time"
)

// TestE2BDurable runs durable.test.mjs (pause and resume, lifecycle,
// snapshots through the real SDK 2.51.0) on every wall.
func TestE2BDurable(t *testing.T) {
	for _, wall := range []string{"process", "runc", "gvisor", "microvm"} {
		t.Run(wall, func(t *testing.T) {
			if wall != "process" {
				requireWall(t, wall)
			}
			d := startDaemon(t, "--wall", wall)
			if wall == "microvm" {
				d.template = "base"
			}
			dir := sdkDir(t)
			args := []string{"--test", "--test-reporter=spec", "durable.test.mjs"}
			if err := runNode(t, dir, d.sdkEnv("e2b", d.key), 10*time.Minute, args...); err != nil {
				t.Errorf("durable state through the E2B SDK on the %s wall: %v (the daemon's log follows the test)", wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}
