// Package wall is what every wall (isolation tier) offers the host once a
// sandbox runs behind it. A wall only starts cage-agent behind its isolation
// and hands the host a way to reach it; commands, files and PTYs then behave
// the same on every wall, through the agent. The walls are subpackages:
// process (namespaces, pure Go), oci (runc and gVisor's runsc).
package wall

import (
	"context"
	"errors"
	"net"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/network"
)

// Sandbox is a running sandbox, seen from the host.
type Sandbox interface {
	ID() string
	Token() string // the agent's access token
	AgentPID() int // the agent's host pid
	Wall() string  // "process", "runc", "gvisor"
	Dial(ctx context.Context) (net.Conn, error)
	Exited() <-chan struct{}   // closed when the sandbox is gone
	Err() error                // why it died, once Exited is closed
	Cgroup() *cgroups.Cgroup   // where its limits and counters are
	DiskPath() string          // a host path on the sandbox's writable storage (for its usage)
	Network() *network.Sandbox // its network; nil when it has none (loopback only)
	Destroy() error            // kill everything and remove it; idempotent
}

// Error kinds a wall reports; callers map them to exit codes and HTTP
// statuses at the edge (internal/sandbox re-exports them).
var (
	// ErrUnavailable: the host lacks what the wall needs.
	ErrUnavailable = errors.New("unavailable on this host")
	// ErrInvalid: the request cannot be made on this wall.
	ErrInvalid = errors.New("invalid")
	// ErrStale: a prepared sandbox was built from another copy of its
	// template's files than the one now current (the host's /etc changed
	// meanwhile); its creator makes a fresh one.
	ErrStale = errors.New("prepared sandbox was built from an older copy of its template")
	// ErrStopped: a checkpoint failed, and the sandbox stopped with it
	// (see Checkpointable).
	ErrStopped = errors.New("the sandbox stopped with its failed checkpoint")
)
