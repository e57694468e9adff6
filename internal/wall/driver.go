package wall

import (
	"context"
	"encoding/json"
	"io"
	"os"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/template"
)

// Driver is one wall: how the host makes sandboxes behind it. The drivers
// are listed in one table (internal/sandbox's registry); nothing else
// switches on a wall's name. Optional abilities are the small interfaces
// below, found by type assertion.
type Driver interface {
	// Name is the wall's name in requests ("process", "runc", ...).
	Name() string
	// Missing says what this host lacks for the wall, nil when nothing.
	Missing() error
	// Create makes a sandbox from spec and starts its agent.
	Create(ctx context.Context, spec Spec) (Sandbox, error)
	// Adopt takes charge of a running sandbox another process created
	// (a daemon restarted after a crash).
	Adopt(a Adoption) (Sandbox, error)
}

// Spec is one sandbox as a driver makes it: built once by the registry,
// after validation, in bytes.
type Spec struct {
	ID       string
	Token    string // the agent's access token
	Hostname string
	Template *template.Template
	// Limits are the sandbox's: the workload's, with the agent's threads
	// added to the pids.
	Limits    cgroups.Limits
	DiskBytes int64             // the writable storage (/tmp, /home, /var/tmp)
	ShmBytes  int64             // /dev/shm
	Env       map[string]string // the template's, overridden by the request's
	MaxOutput int64             // output forwarded per command (0: the agent's default)
	// DieWithCaller ties the sandbox to the creating process (cage run).
	DieWithCaller bool
	// Net gives the sandbox a network under NetPolicy (nil, or a policy
	// of mode none: loopback only).
	Net       *network.Host
	NetPolicy network.Policy
	// Volumes are mounted in the sandbox (E2B's volumeMounts) by drivers
	// that are VolumeMounters; the registry refuses them on other walls.
	Volumes []Volume
	// Run, when set, is the one command the sandbox is made for (cage
	// run): its agent starts it as soon as it is sealed, on descriptors
	// the caller gave, and serves nothing over HTTP. Only
	// OneShotRunners take it; the registry refuses it elsewhere.
	Run *Run
}

// Run is a one-shot sandbox's command and its descriptors: pipes the
// caller made (never a file, socket or terminal of the host's: the
// sandbox holds its ends). The caller closes them once the sandbox is
// made.
type Run struct {
	Cmd  string
	Args []string
	Cwd  string // "" is the user's home
	User string // "" is the sandbox's user
	Env  map[string]string
	// Stdin, Stdout and Stderr are the command's.
	Stdin, Stdout, Stderr *os.File
	// Control is read by the agent: each byte a signal for the command.
	Control *os.File
	// Status is where the agent writes how the command ended (one JSON
	// line, agent.OneShotEnd) before it exits.
	Status *os.File
}

// MaxRunSize bounds a one-shot run's command as the sandbox's first
// document holds it (Run.Size): that document is read to 1 MiB, with the
// rest of the spec. A larger command (argv of several 128 KiB strings,
// which the RPC path takes in a message of up to 16 MiB) goes that way.
const MaxRunSize = 256 << 10

// Size is how many bytes r's command, arguments, directory, user and
// environment take in JSON.
func (r *Run) Size() int {
	b, _ := json.Marshal(struct {
		Cmd, Cwd, User string
		Args           []string
		Env            map[string]string
	}{r.Cmd, r.Cwd, r.User, r.Args, r.Env})
	return len(b)
}

// OneShotRunner is a driver whose sandboxes can be made for one command
// (Spec.Run).
type OneShotRunner interface {
	RunsOnce()
}

// Volume is a volume a sandbox mounts: the host's mount of it, as a
// descriptor of its root that the wall clones the mount from (never a
// path), and where the sandbox sees it.
type Volume struct {
	Path string   // inside the sandbox: absolute, clean
	Root *os.File // the volume's root on the host; the caller closes it
}

// VolumeMounter is a driver whose sandboxes can mount volumes (Spec.Volumes).
type VolumeMounter interface {
	// VolumesMissing says why the wall cannot mount volumes on this host
	// (nil: it can).
	VolumesMissing() error
}

// Adoption names a sandbox another process created, as its record says.
type Adoption struct {
	ID        string
	PID       int    // its agent's host pid
	StartTime uint64 // the agent's start time, against pid reuse
	Token     string
	// Slot is the sandbox's network slot when it has a network (-1: none
	// recorded), whose host lock an adopting process takes again (and
	// the sandbox's own lock where nothing inside the sandbox holds it: a
	// sandbox restored from a checkpoint); see state.IDRange.
	Slot int
}

// Checkpointer is a driver whose sandboxes can be checkpointed: saved
// whole (memory, processes, files) into a directory and stopped, every
// byte of their RAM released, then restored from it (see Checkpointable).
type Checkpointer interface {
	// CheckpointsMissing says why the wall's sandboxes cannot be
	// checkpointed here (nil: they can).
	CheckpointsMissing() error
	// AdoptCheckpointed takes charge of a sandbox another process
	// checkpointed into dir (a daemon restarted): spec is the sandbox's
	// as when it was made (id, token, template, limits, network), slot
	// its network slot (-1: none). The sandbox returned is stopped;
	// its Restore starts it. An error means the checkpoint cannot be
	// used here (the host restarted, the slot is taken): the caller
	// resumes the sandbox some other way and removes dir.
	AdoptCheckpointed(ctx context.Context, spec Spec, slot int, dir string) (Sandbox, error)
}

// Checkpointable is a sandbox of a Checkpointer. The host stores what the
// wall's runtime writes into the directory and never reads it: only the
// runtime (runsc, QEMU) does, when the same sandbox is restored.
type Checkpointable interface {
	// Checkpoint saves the running sandbox into dir (made by the caller,
	// empty) and stops it, releasing its memory; the sandbox keeps its
	// id, token and network slot for Restore. On error the sandbox runs
	// on as before and dir holds nothing to use; or, where the runtime
	// cannot undo its stop (gVisor's save failing midway), the error is
	// ErrStopped: its processes are gone (the caller destroys it).
	Checkpoint(ctx context.Context, dir string) error
	// Restore starts a checkpointed sandbox again from dir, with the same
	// id, token and network; its processes go on where they stood and
	// Dial reaches its agent. started, when not nil, is called once the
	// runtime has the sandbox running again and before its agent is
	// waited for: from then on the wait is the sandbox's (a compromised
	// agent or guest answers when it chooses, up to ctx), and a caller
	// lets go there of what other sandboxes wait for. On error the
	// sandbox stays stopped (the caller destroys it).
	Restore(ctx context.Context, dir string, started func()) error
}

// Preparer is a driver that can make sandboxes ahead of their request (a
// pool): everything but what the request says, which Start then applies.
type Preparer interface {
	Prepare(ctx context.Context, spec Spec, background bool) (Prepared, error)
}

// Prepared is a sandbox made ahead of its request.
type Prepared interface {
	Sandbox
	// Start applies the request's part of spec (token, limits, sizes,
	// environment, network) and lets the agent serve.
	Start(spec Spec) error
}

// NetPreparer is a Preparer whose sandboxes get their network interface,
// or none, as they are prepared (gVisor's netstack and a VM's NIC are made
// then): a pool prepares them with spec.Net set, under a policy that
// allows nothing until Start sets the request's, or without, and hands
// them only to creates of the same kind (see Fitter).
type NetPreparer interface {
	Preparer
	PreparesNetwork() bool
}

// Warmer is a Preparer whose sandboxes serve their first command slowly
// until one has run (a VM under TCG translates every guest instruction
// anew in each QEMU): where WarmsUp, a pool starts its sandboxes with an
// identity of its own (a fresh id, token and hostname, default sizes and
// limits, no environment) and runs a command in each before handing it
// out, and so serves only creates that ask for no more than that.
type Warmer interface {
	Preparer
	WarmsUp() bool
}

// Fitter is a Prepared that fixed, as it was prepared, some of what a
// create may ask for (a network interface or none, a VM's size, a disk's
// or /dev/shm's size): it serves only creates whose spec Fits. A Prepared
// that is not a Fitter serves any create of its template.
type Fitter interface {
	Fits(spec Spec) bool
}

// Staler is a Prepared that can tell it was made from what is no longer
// current: its template imported again, or the agent, kernel or runtime it
// runs changed on the host. A pool destroys such a sandbox unused.
type Staler interface {
	Stale(t *template.Template) bool
}

// Networked is a sandbox whose network can be handed over after adoption.
type Networked interface {
	SetNetwork(n *network.Sandbox)
}

// Describer is a driver with something to tell people about the wall on
// this host (cage doctor, warnings at create): accel, say, or a platform.
type Describer interface {
	// Describe is a short note for cage doctor ("" for none).
	Describe(ctx context.Context) string
	// Warning is what users must be told when they create a sandbox on
	// this wall here ("" for nothing): e.g. that it is no boundary.
	Warning(ctx context.Context) string
}

// DefaultTemplater is a driver whose sandboxes start from a template of its
// own when a request names none.
type DefaultTemplater interface {
	DefaultTemplate() string
}

// BareRunner is a driver that can run a command straight in its runtime,
// without cage's agent: the peer its benchmarks are measured against.
type BareRunner interface {
	RunBare(ctx context.Context, spec Spec, argv []string, out io.Writer) error
}
