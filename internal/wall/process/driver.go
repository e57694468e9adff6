package process

import (
	"context"
	"log/slog"

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

// Prepare makes a sandbox of spec's template, id and sizes that waits for
// Start (see prepare); background prepares at low CPU priority.
func (d *Driver) Prepare(ctx context.Context, spec wall.Spec, background bool) (wall.Prepared, error) {
	sb, err := prepare(ctx, job{Config: d.cfg, Spec: spec, Background: background})
	if err != nil {
		return nil, err
	}
	return sb, nil
}

// Adopt takes charge of a sandbox another process created (see adopt).
func (d *Driver) Adopt(a wall.Adoption) (wall.Sandbox, error) {
	return adopt(d.cfg, a)
}
