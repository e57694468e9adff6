// Package abuse is cage's abuse and load suite: what a hostile tenant, an
// anonymous client of the proxy or code inside a sandbox can throw at a
// running `cage serve`, each with the outcome it must have and, where an
// attack costs the host something, a bound on that cost. It runs in CI at
// modest sizes; CAGE_ABUSE_SCALE=N multiplies the sizes on demand.
//
// Figures (memory, latency) are logged for the closing notes and
// SECURITY.md; the bounds the tests assert are on memory and outcomes,
// never on time.
package abuse

import (
	"os"
	"strconv"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// scale multiplies a CI-sized count by CAGE_ABUSE_SCALE (default 1).
func scale(n int) int {
	if s, err := strconv.Atoi(os.Getenv("CAGE_ABUSE_SCALE")); err == nil && s > 1 {
		return n * s
	}
	return n
}
