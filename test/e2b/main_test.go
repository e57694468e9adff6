package e2b

import (
	"os"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// E2B's sandboxes have the internet by default: the suite runs in a network
// namespace of its own, with testutil's world as the outside.
func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }
