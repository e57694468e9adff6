// Package seal is how cage-agent takes every privilege it does not need,
// for good, before it serves: on every wall whose runtime leaves that to the
// agent (the process wall, and the OCI walls, where it repeats in the agent
// what the runtime's own settings already do, so that one policy holds
// everywhere).
//
// Order matters: SpawnThread runs first, on the one thread that forks
// commands (it needs CAP_SETPCAP); then Seal: Landlock (while threads still
// hold CAP_SYS_ADMIN), the agent's own uid with only the capabilities it
// needs, no_new_privs, and the seccomp filter (whose TSYNC spreads
// no_new_privs to every thread).
package seal

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/seccomp"
)

// Options says how to seal.
type Options struct {
	AgentUID      int  // the agent's own uid (and gid) inside the sandbox
	DieWithParent bool // re-arm the parent-death signal after the uid change
	Trace         func(string)
	// WritableRoot lets the sandbox write its whole root (an image
	// template's overlay, whose upper layer is the sandbox's disk);
	// otherwise only its storage directories.
	WritableRoot bool
	// Writable are more directories the sandbox may write under: the
	// volumes mounted in it.
	Writable []string
	// Readable are more directories it may read under, outside its root:
	// the microvm guest's root overlay's upper layer, its own files, which
	// its agent archives from there.
	Readable []string
}

// SpawnThread prepares the calling thread, the agent's spawning thread (see
// caps.go).
func SpawnThread() error { return spawnThreadSetup() }

// SpawnThreadForBuild prepares the spawning thread of a template build's
// sandbox: commands run as root there keep the agent's capabilities
// (chown, setuid, ... within the sandbox's user namespace), as package
// managers need; everything else stays as in SpawnThread's sandboxes.
func SpawnThreadForBuild() error { return spawnThreadSetupBuild() }

// AllThreads runs a system call on every thread of the process.
func AllThreads(trap, a1, a2, a3 uintptr) error { return allThreads(trap, a1, a2, a3) }

// Seal takes the privileges. It returns the Landlock ABI used (0: none).
func Seal(o Options) (int, error) {
	trace := o.Trace
	if trace == nil {
		trace = func(string) {}
	}
	trace("landlock")
	abi, err := applyLandlock(o.WritableRoot, o.Writable, o.Readable)
	if err != nil {
		return abi, fmt.Errorf("landlock: %w", err)
	}
	trace("privileges")
	if err := dropPrivileges(o.AgentUID); err != nil {
		return abi, fmt.Errorf("privileges: %w", err)
	}
	if o.DieWithParent {
		// Changing uid cleared the parent-death signal; arm it again.
		if err := allThreads(unix.SYS_PRCTL, unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0); err != nil {
			return abi, fmt.Errorf("parent-death signal: %w", err)
		}
	}
	trace("seccomp")
	if err := seccomp.Install(); err != nil {
		return abi, fmt.Errorf("seccomp: %w", err)
	}
	return abi, nil
}
