// Command cage creates disposable sandboxes for AI agents: `cage run -- CMD`
// runs a command behind a wall and burns the sandbox afterwards.
package main

import (
	"math"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cli"
)

func main() {
	// Descriptors inherited from the caller must never reach a sandbox:
	// everything above stderr becomes close-on-exec before anything forks.
	_ = unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC)
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
