package e2b

import (
	"testing"
	"time"
)

// TestE2BVolumes runs volumes.test.mjs (Volume create, write, read, list,
// metadata, remove and destroy; a volume mounted in two sandboxes one
// after the other; getMetrics over a range) through the real SDK 2.51.0 on
// the process wall and on runc and gVisor where present. The content API
// is the daemon's API address, as E2B_VOLUME_API_URL tells the SDK. The
// microvm wall refuses volumes (see docs/SPECIFICATION.md).
func TestE2BVolumes(t *testing.T) {
	for _, wall := range []string{"process", "runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) {
			if wall != "process" {
				requireWall(t, wall)
			}
			d := startDaemon(t, "--wall", wall)
			env := append(d.sdkEnv("e2b", d.key), "E2B_VOLUME_API_URL="+d.apiURL)
			args := []string{"--test", "--test-reporter=spec", "volumes.test.mjs"}
			if err := runNode(t, sdkDir(t), env, 10*time.Minute, args...); err != nil {
				t.Errorf("volumes and metrics through the E2B SDK on the %s wall: %v (the daemon's log follows the test)", wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}
