// Command cage creates disposable sandboxes for AI agents: `cage run -- CMD`
// runs a command behind a wall and burns the sandbox afterwards.
package main

import (
	"os"

	"github.com/cagehq/cage/internal/cli"
)

func main() {
	os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr))
}
