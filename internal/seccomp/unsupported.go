//go:build linux && !amd64

package seccomp

import (
	"errors"
	"runtime"

	"golang.org/x/sys/unix"
)

var errUnsupported = errors.New("seccomp: the filter is only written for linux/amd64, not " + runtime.GOARCH)

// Install fails on this architecture, so that a sandbox never silently runs
// without its filter.
func Install() error { return errUnsupported }

// Program fails on this architecture.
func Program() ([]unix.SockFilter, error) { return nil, errUnsupported }
