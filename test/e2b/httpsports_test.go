package e2b

import (
	"testing"
	"time"
)

// TestE2BHTTPSPorts runs httpsports.test.mjs (network.httpsPorts through
// the real SDK 2.51.0: create passes it, getInfo shows it, a TLS server
// inside is reached over the proxy in plain HTTP, 49983 and bad ports are
// refused) on the process wall.
func TestE2BHTTPSPorts(t *testing.T) {
	d := startDaemon(t)
	args := []string{"--test", "--test-reporter=spec", "httpsports.test.mjs"}
	if err := runNode(t, sdkDir(t), d.sdkEnv("e2b", d.key), 5*time.Minute, args...); err != nil {
		t.Errorf("network.httpsPorts through the E2B SDK: %v (the daemon's log follows the test)", err)
	}
	d.checkNoSandboxesLeft(t)
	d.stop(t)
}
