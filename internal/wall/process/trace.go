package process

import (
	"fmt"
	"os"
	"time"
)

// tracing prints timestamps of setup phases to stderr when CAGE_TRACE is set
// (host side) or the spec asks for it (child side); for finding where start
// time goes, not for tests.
var tracing = os.Getenv("CAGE_TRACE") != ""

func trace(what string) {
	if tracing {
		fmt.Fprintf(os.Stderr, "trace %s %s pid=%d\n", time.Now().Format("05.000000"), what, os.Getpid())
	}
}

// Trace is trace for cage-agent's main.
func Trace(what string) { trace(what) }
