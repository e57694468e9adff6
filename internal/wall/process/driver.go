package process

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall/state"

	"github.com/cagehq/cage/internal/wall"
)

// Driver is the process wall: cage's embedded default, which this host can
// always run (the registry checks the kernel's namespaces before any wall).
type Driver struct{ cfg Config }

// NewDriver returns the process wall's driver.
func NewDriver(cfg Config) *Driver {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Driver{cfg: cfg}
}

// Name is "process".
func (d *Driver) Name() string { return "process" }

// Missing is nil: the wall is pure Go.
func (d *Driver) Missing() error { return nil }

// Create prepares and starts a sandbox. The agent may still be setting up
// when Create returns; Dial connects as soon as the agent accepts
// (connections queue on the listening socket meanwhile). On error nothing
// is left behind.
func (d *Driver) Create(ctx context.Context, spec wall.Spec) (wall.Sandbox, error) {
	sb, err := prepare(ctx, job{Config: d.cfg, Spec: spec})
	if err != nil {
		return nil, err
	}
	if err := sb.Start(spec); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	return sb, nil
}

// RunsOnce: the agent can start a spec's one command itself (wall.Run).
func (d *Driver) RunsOnce() {}

// Prepare makes a sandbox of spec's template, id and sizes that waits for
// Start (see prepare); background prepares at low CPU priority.
func (d *Driver) Prepare(ctx context.Context, spec wall.Spec, background bool) (wall.Prepared, error) {
	agent, err := state.FileID(d.cfg.AgentPath) // before the agent starts: a change after it reads as stale
	if err != nil {
		return nil, fmt.Errorf("the sandbox's agent %s: %w", d.cfg.AgentPath, err)
	}
	sb, err := prepare(ctx, job{Config: d.cfg, Spec: spec, Background: background})
	if err != nil {
		return nil, err
	}
	sb.agentPath, sb.agentID = d.cfg.AgentPath, agent
	// Its limits now (a pool's are the defaults): a create that asks the
	// same does not write them again.
	if err := sb.cg.Apply(spec.Limits); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	sb.limits = spec.Limits
	// A networked spec's interface is made now, under its policy (a pool's
	// allows nothing), so that a create pays only for the policy it asks.
	sb.prepared = true
	if err := sb.attachNetwork(spec); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	return sb, nil
}

// PreparesNetwork is true: a prepared sandbox gets its network interface,
// or none, as it is made (see wall.NetPreparer).
func (d *Driver) PreparesNetwork() bool { return true }

// Fits says whether a create of spec can be given this prepared sandbox:
// one with a network interface serves networked creates, one without the
// others; and only creates of the disk (but where the host resizes it: an
// image root's) and /dev/shm sizes it was built with, which its sealed
// agent can no longer change.
func (sb *Sandbox) Fits(spec wall.Spec) bool {
	if !sb.prepared {
		return true
	}
	disk, shm := spec.DiskBytes, spec.ShmBytes
	if disk == 0 {
		disk = sb.disk
	}
	if shm == 0 {
		shm = sb.shm
	}
	return networked(spec) == (sb.net != nil) && (sb.image || disk == sb.disk) && shm == sb.shm
}

// Adopt takes charge of a sandbox another process created (see adopt).
func (d *Driver) Adopt(a wall.Adoption) (wall.Sandbox, error) {
	return adopt(d.cfg, a)
}

// Stale says whether the prepared sandbox was made from other files than
// t's now, or with another agent binary than the host has now.
func (sb *Sandbox) Stale(t *template.Template) bool {
	if !sb.prepared {
		return false
	}
	if t == nil || t.Name != sb.template || t.EtcCache != sb.etc || (t.Image != nil) != sb.image ||
		(t.Image != nil && t.Image.Info.ID != sb.imageID) {
		return true
	}
	agent, err := state.FileID(sb.agentPath)
	return err != nil || agent != sb.agentID
}
