package sandbox

import (
	"errors"
	"fmt"
	"math"

	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/units"
	"github.com/cagehq/cage/internal/wall"
)

// Error kinds; callers map them to exit codes and HTTP statuses at the edge.
var (
	ErrInvalid     = wall.ErrInvalid
	ErrNotFound    = template.ErrNotFound
	ErrPermission  = errors.New("permission denied")
	ErrUnavailable = wall.ErrUnavailable
	// ErrNoOneShot: the sandbox cannot be made for its one command
	// (Options.Run): its wall cannot, its template has a start command
	// to run first, or the command is larger than wall.MaxRunSize. The caller makes it the usual way instead.
	ErrNoOneShot = errors.New("this sandbox cannot run its command on the one-shot path")
)

// Defaults for a sandbox when the request names no limit.
const (
	DefaultMemory = 512 << 20
	DefaultCPUs   = 1.0
	DefaultPids   = 512
	DefaultDisk   = 256 << 20
	DefaultShm    = 64 << 20
)

// Minimums below which a sandbox cannot even start its agent.
const (
	MinMemory = 32 << 20
	MinPids   = 16
	MinDisk   = 1 << 20
	MinCPUs   = 0.01
)

// Options are what a caller may choose for a sandbox.
type Options struct {
	Wall      string // "process" (default), "runc", "gvisor" or "microvm"
	ID        string // "" = a fresh one
	Token     string // the agent's access token; "" = a fresh one
	Template  string
	Memory    int64
	CPUs      float64
	Pids      int64
	Disk      int64
	Shm       int64
	Env       map[string]string
	MaxOutput int64
	// DieWithCaller ties the sandbox to the creating process (cage run).
	DieWithCaller bool
	// Net is what the sandbox may reach; mode none (the default) is
	// loopback only.
	Net network.Policy
	// Max is the ceiling on the limits above (zero fields: the host's
	// defaults); the daemon sets its operator's.
	Max Maxima
	// Volumes are mounted in the sandbox (see CheckVolumePath); the
	// caller opened them and closes them once it has started.
	Volumes []wall.Volume
	// Run makes the sandbox for one command (wall.Spec.Run: cage run):
	// never from a pool; ErrNoOneShot where it cannot be.
	Run *wall.Run
	// BuildStep is a template build's RUN step (internal/build): only
	// such a create may name a build's template (one SetTemplate set with
	// Build), and it may name nothing else. For any other create a
	// build's template does not exist, so that no client who learns its
	// name (the step sees it in its mountinfo) gets a sandbox of it.
	BuildStep bool
}

// Validate fills the limits' defaults and rejects limits that are
// malformed, too small or above the maxima. (The template's default is the
// wall's: the registry fills it.)
func (o *Options) Validate() error {
	if o.Memory == 0 {
		o.Memory = DefaultMemory
	}
	if o.CPUs == 0 {
		o.CPUs = DefaultCPUs
	}
	if o.Pids == 0 {
		o.Pids = DefaultPids
	}
	if o.Disk == 0 {
		o.Disk = DefaultDisk
	}
	if o.Shm == 0 {
		o.Shm = min(DefaultShm, o.Memory/4)
	}
	switch {
	case o.Memory < MinMemory:
		return fmt.Errorf("%w: memory %s is too small (at least %s)", ErrInvalid, units.FormatSize(o.Memory), units.FormatSize(MinMemory))
	case !(o.CPUs >= MinCPUs) || math.IsInf(o.CPUs, 0): // NaN too
		return fmt.Errorf("%w: cpus %g is out of range (at least %g)", ErrInvalid, o.CPUs, MinCPUs)
	case o.Pids < MinPids:
		return fmt.Errorf("%w: pids %d is too small (at least %d)", ErrInvalid, o.Pids, MinPids)
	case o.Disk < MinDisk:
		return fmt.Errorf("%w: disk %s is too small (at least %s)", ErrInvalid, units.FormatSize(o.Disk), units.FormatSize(MinDisk))
	case o.Shm < 0:
		return fmt.Errorf("%w: negative shm size", ErrInvalid)
	}
	if err := o.Max.check(o); err != nil {
		return err
	}
	for k := range o.Env {
		if k == "" || containsAny(k, "=\x00") {
			return fmt.Errorf("%w: environment variable name %q", ErrInvalid, k)
		}
	}
	if err := o.Net.Validate(); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return checkVolumes(o.Volumes)
}

func containsAny(s, chars string) bool {
	for _, c := range chars {
		for _, d := range s {
			if c == d {
				return true
			}
		}
	}
	return false
}
