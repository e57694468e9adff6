package daemontest

import (
	"os"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// The daemon's sandboxes get a network by default (E2B's routes default to
// the internet): the tests run in a network namespace of their own, with
// testutil's world as the outside.
func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }
