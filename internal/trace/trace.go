// Package trace prints the timestamps of setup phases to stderr, on the host
// when CAGE_TRACE is set and inside a sandbox when its spec asks for it: for
// finding where start time goes, not for tests. It is a leaf: the host and
// every wall's inside half use it.
package trace

import (
	"fmt"
	"os"
	"sync/atomic"
	"time"
)

var on atomic.Bool

func init() { on.Store(os.Getenv("CAGE_TRACE") != "") }

// On reports whether tracing is on.
func On() bool { return on.Load() }

// Set turns tracing on or off (a sandbox's agent, as its spec says).
func Set(v bool) { on.Store(v) }

// Mark prints one phase's timestamp when tracing is on.
func Mark(what string) {
	if on.Load() {
		fmt.Fprintf(os.Stderr, "trace %s %s pid=%d\n", time.Now().Format("05.000000"), what, os.Getpid())
	}
}
