package uitest

import (
	"os"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// The daemon's sandboxes get a network by default: the suite runs in a
// network namespace of its own, as test/daemon's does.
func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }
