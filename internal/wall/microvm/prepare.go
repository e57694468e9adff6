package microvm

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// A prepared sandbox (a pool's, wall.Preparer) is a VM restored from its
// shape's snapshot as Create restores one, with its pool's id, network
// slot and QEMU's host cgroup, whose guest said hello and holds the
// session, waiting for its spec. It has no identity yet: no token,
// hostname, random bytes, clock, limits, address or environment; the
// agent does not serve. Start sends the request's spec, which gives the
// guest all of them before its agent serves (see guest.Spec), so that no
// two sandboxes share what a snapshot would have made common.
//
// The VM's shape stays what it was prepared with: its RAM and vCPUs (the
// request's memory and CPU limits size them) and whether it has a NIC.
// Fits says so.

// preparation is what a prepared VM was made from.
type preparation struct {
	imageID   string
	agentSum  string // the agent's sha256 (its initramfs)
	shapeKey  string // the snapshot's shape: kernel, QEMU, image, size, NIC
	networked bool
	started   bool
}

// startTimeout bounds Start: the guest's agent starting under TCG.
const startTimeout = 60 * time.Second

// prepared records what sb was prepared from.
func (sb *Sandbox) prepared() error {
	sh, err := shapeOf(sb.vcfg)
	if err != nil {
		return err
	}
	sum, err := fileSum(sb.cfg.AgentPath)
	if err != nil {
		return err
	}
	sb.prep = &preparation{imageID: sb.cfg.Template.Image.Info.ID, agentSum: sum, shapeKey: sh.key(), networked: sb.net != nil}
	return nil
}

// Prepare restores a VM for spec (its id, template, limits for the VM's
// size, and a NIC with a network under spec.NetPolicy when spec.Net is
// set) that waits for Start.
func (d *Driver) Prepare(ctx context.Context, spec wall.Spec, background bool) (wall.Prepared, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	if spec.Template.Image == nil {
		return nil, fmt.Errorf("%w: the microvm wall runs image templates, not %q", wall.ErrInvalid, spec.Template.Name)
	}
	if spec.DieWithCaller || len(spec.Volumes) > 0 {
		return nil, fmt.Errorf("%w: a prepared sandbox has no caller to die with and no volumes", wall.ErrInvalid)
	}
	k, _ := d.guestKernel()
	accel, _ := d.Accel(ctx)
	sb, err := Create(ctx, Config{Spec: spec, RunDir: d.cfg.RunDir, Cache: d.cfg.Cache, AgentPath: d.cfg.AgentPath,
		Kernel: k, Cgroups: d.cfg.Cgroups, Accel: accel, Log: d.cfg.Log, prepare: true, background: background})
	if err != nil {
		return nil, fmt.Errorf("microvm: %w", err)
	}
	return sb, nil
}

// Foreground puts QEMU back to the normal priority: a pool's VM is
// restored, and under TCG started and warmed up, at vm.BackgroundNice and
// in a group of the least CPU weight (so that refilling a pool takes
// little from the sandboxes running and the creates it serves: the nice
// orders QEMU's threads among themselves, the weight its group among the
// sandboxes'), until a create takes it.
func (sb *Sandbox) Foreground() {
	if sb.cg != nil && sb.cfg.background {
		if err := sb.cg.SetBackground(false); err != nil {
			logger(sb.cfg).Warn("a pooled VM's CPU weight", "sandbox", sb.id, "err", err)
		}
	}
	if sb.v != nil {
		sb.v.Foreground()
	}
}

// PreparesNetwork is true: the VM's NIC is part of its shape (see
// wall.NetPreparer).
func (d *Driver) PreparesNetwork() bool { return true }

// WarmsUp is true under TCG, where a restored VM's first command takes
// the translation of every instruction on its path (see wall.Warmer).
func (d *Driver) WarmsUp() bool {
	accel, _ := d.Accel(context.Background())
	return accel != "kvm"
}

// Stale says whether the VM was prepared from another image than t's, or
// with another agent, kernel or QEMU than the host has now.
func (sb *Sandbox) Stale(t *template.Template) bool {
	p := sb.prep
	if p == nil {
		return false
	}
	if t == nil || t.Image == nil || t.Image.Info.ID != p.imageID {
		return true
	}
	if sum, err := fileSum(sb.cfg.AgentPath); err != nil || sum != p.agentSum {
		return true
	}
	sh, err := shapeOf(sb.vcfg)
	return err != nil || sh.key() != p.shapeKey
}

// Fits says whether a create of spec can be given this VM: the same size
// (from its memory and CPU limits) and a NIC when it has a network.
func (sb *Sandbox) Fits(spec wall.Spec) bool {
	p := sb.prep
	if p == nil || p.started || spec.DieWithCaller || len(spec.Volumes) > 0 {
		return false
	}
	c := sb.cfg
	c.Spec = spec
	memMB, cpus := vmSize(c)
	networked := spec.Net != nil && spec.NetPolicy.Networked()
	return memMB == sb.vcfg.MemoryMB && cpus == sb.vcfg.CPUs && networked == p.networked
}

// Start gives the prepared VM its request: the network policy on the
// host, then the spec to the guest; it returns once the agent serves.
// wall.ErrStale when the VM was prepared from what is no longer current.
func (sb *Sandbox) Start(spec wall.Spec) error {
	p := sb.prep
	if p == nil || p.started {
		return errors.New("sandbox already started")
	}
	if sb.Stale(spec.Template) {
		return wall.ErrStale
	}
	if !sb.Fits(spec) {
		return fmt.Errorf("%w: the prepared VM does not fit the request", wall.ErrInvalid)
	}
	p.started = true
	sb.token = spec.Token
	sb.cfg.Spec = spec
	if sb.net != nil {
		if err := sb.net.SetPolicy(spec.NetPolicy); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	return sb.start(ctx, spec)
}
