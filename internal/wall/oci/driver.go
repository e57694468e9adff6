package oci

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"

	"github.com/cagehq/cage/internal/wall"
)

// Driver is an OCI wall: runc, or gVisor's runsc.
type Driver struct {
	name    string
	cfg     Config // cfg.Runtime is nil where the runtime is missing
	install string // how to get the runtime
}

// NewRunc returns the runc wall: runc on the PATH.
func NewRunc(cfg Config) *Driver {
	cfg.Runtime = nil
	if p, err := exec.LookPath("runc"); err == nil {
		cfg.Runtime = &Runtime{Wall: "runc", Binary: p}
	}
	return newDriver("runc", cfg, "runc (apt-get install runc)")
}

// NewGVisor returns the gVisor wall: runsc ($CAGE_RUNSC, else on the PATH)
// with the systrap platform (no KVM needed), no network of its own, and
// host sockets it may connect to (the agent's channel) but never create.
//
// --qdisc=none: the netstack's TCP sender writes its (GSO-sized) packets to
// the sandbox's AF_PACKET socket itself, instead of queueing them for the
// fifo qdisc's goroutine, runsc's default, which writes them. The handoff
// costs a goroutine wake-up per batch, and on a busy host a wait for a CPU
// that the sender, clocked by returning ACKs, then spends sending smaller
// segments. On the 2-core development host a stream out of a sandbox cost
// its cgroup 9-38% less CPU (7 sandbox pairs, median 16%) and the sentry
// up to 40% fewer context switches with none; its throughput against the
// host's rose in most runs (0.48 to 0.87 at load 5), not in all
// (docs/BENCHMARKS.md). It changes only where the sentry queues packets it
// sends: not what the sandbox reaches (the veth, the host's nftables and
// NAT are the same) nor what it sees.
func NewGVisor(cfg Config) *Driver {
	cfg.Runtime = nil
	runsc := os.Getenv("CAGE_RUNSC")
	if runsc == "" {
		runsc, _ = exec.LookPath("runsc")
	}
	if runsc != "" {
		if _, err := os.Stat(runsc); err == nil {
			cfg.Runtime = &Runtime{Wall: "gvisor", Binary: runsc,
				Flags: slices.Clone(gvisorFlags)}
		}
	}
	return newDriver("gvisor", cfg, "runsc (make runsc, or set CAGE_RUNSC)")
}

// gvisorFlags are runsc's global flags (see NewGVisor); a networked
// sandbox's --network=none becomes --network=sandbox (Runtime.flags).
var gvisorFlags = []string{"--platform=systrap", "--network=none", "--host-uds=open", "--qdisc=none"}

func newDriver(name string, cfg Config, install string) *Driver {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Driver{name: name, cfg: cfg, install: install}
}

// Name is the wall's name: "runc" or "gvisor".
func (d *Driver) Name() string { return d.name }

// Missing says when the runtime is not on this host.
func (d *Driver) Missing() error {
	if d.cfg.Runtime == nil {
		return fmt.Errorf("%w: the %s wall needs %s", wall.ErrUnavailable, d.name, d.install)
	}
	return nil
}

// Create builds the bundle and starts the container, whose init is the
// agent. On error nothing is left behind.
func (d *Driver) Create(ctx context.Context, spec wall.Spec) (wall.Sandbox, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	sb, err := create(ctx, job{Config: d.cfg, Spec: spec})
	if err != nil {
		return nil, err
	}
	return sb, nil
}

// Adopt takes charge again of a running container whose creator is gone.
func (d *Driver) Adopt(a wall.Adoption) (wall.Sandbox, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	sb, err := adopt(d.cfg, a)
	if err != nil {
		return nil, err
	}
	return sb, nil
}

// RunBare runs argv as the container's process, without the agent, in the
// foreground, with stdout to out, in a bundle built exactly as a sandbox's
// (same root, mounts, namespaces, cgroups): the peer `cage bench` measures
// the wall against. Everything is removed afterwards.
func (d *Driver) RunBare(ctx context.Context, spec wall.Spec, argv []string, out io.Writer) error {
	if err := d.Missing(); err != nil {
		return err
	}
	return runBareJob(ctx, job{Config: d.cfg, Spec: spec, bare: argv, bareOut: out})
}

// Describe names the runtime and its flags, and gVisor's platform.
func (d *Driver) Describe(context.Context) string {
	if d.cfg.Runtime == nil {
		return ""
	}
	note := strings.TrimSpace(d.cfg.Runtime.Binary + " " + strings.Join(d.cfg.Runtime.Flags, " "))
	if d.name == "gvisor" {
		note += "; platform systrap, which needs no KVM; a networked sandbox gets --network=sandbox: its netstack in the sandbox namespace"
	}
	return note
}

// Warning is none: both runtimes are a boundary wherever they run.
func (d *Driver) Warning(context.Context) string { return "" }
