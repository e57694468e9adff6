package sandbox

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// pools keep sandboxes made ahead of their request on the default wall,
// if its driver can prepare (wall.Preparer), one pool per template, so
// that a create only sends the request's part. A template without a start
// command gets prepared sandboxes (forked into their namespaces and
// cgroups, runtime started, waiting for a spec). A template with one gets
// started sandboxes whose start command has run and passed its ready check
// (code-interpreter-v1: its Python kernel is up), with the pool's fresh id
// and token, the default sizes and no environment of the request's; a
// create takes one only when it asks for nothing it cannot be given after
// the start (see fits), and gets its limits and network policy applied.
// Sandboxes tied to their caller (cage run) never come from a pool.
type pools struct {
	mu     sync.Mutex
	byName map[string]*pool
	misses atomic.Int64 // creates that found their pool empty
}

type pool struct {
	template string
	wall     string
	started  atomic.Bool  // its sandboxes are started (the template has a start command)
	hits     atomic.Int64 // creates it served
	misses   atomic.Int64 // creates that found it empty
	ch       chan wall.Prepared
	cancel   context.CancelFunc
	done     chan struct{}
}

// refillPause is how long a pool waits after handing a sandbox out before
// it prepares the next (on a 2-core host a refill next to a create doubles
// the create's latency).
const refillPause = 10 * time.Millisecond

// StartPool keeps n sandboxes of PoolTemplate prepared on the default wall
// (process), if it can prepare them.
func (h *Host) StartPool(n int) { h.AddPool(h.poolTemplate(), n) }

// AddPool keeps n sandboxes of template name ready on the default wall (see
// pools); a second call for the same template changes nothing.
func (h *Host) AddPool(name string, n int) {
	d, err := h.Driver("")
	prep, ok := d.(wall.Preparer)
	if n <= 0 || err != nil || !ok {
		return
	}
	ps := &h.pool
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.byName == nil {
		ps.byName = map[string]*pool{}
	}
	if ps.byName[name] != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &pool{template: name, wall: d.Name(), ch: make(chan wall.Prepared, n), cancel: cancel, done: make(chan struct{})}
	ps.byName[name] = p
	go p.fill(ctx, h, prep)
}

func (p *pool) fill(ctx context.Context, h *Host, prep wall.Preparer) {
	defer close(p.done)
	wait := time.Second
	for ctx.Err() == nil {
		sb, err := h.prepare(ctx, prep, p)
		if err != nil {
			// A missing template (not built yet) is retried seldom, a
			// failing start command less and less often.
			if errors.Is(err, template.ErrNotFound) {
				wait = 30 * time.Second
			}
			h.Log.Warn("pool: prepare a sandbox", "template", p.template, "err", err, "retry in", wait)
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
			wait = min(2*wait, time.Minute)
			continue
		}
		wait = time.Second
		select {
		case p.ch <- sb:
		case <-ctx.Done():
			_ = sb.Destroy()
			continue
		}
		// The push above often follows a take at once: let the create
		// that took it use the CPU before preparing the next.
		select {
		case <-time.After(refillPause):
		case <-ctx.Done():
		}
	}
}

// prepare makes one sandbox of the pool's template with the default sizes
// (Start resizes), at background CPU priority; for a template with a start
// command, it starts it too and waits for its ready check.
func (h *Host) prepare(ctx context.Context, prep wall.Preparer, p *pool) (wall.Prepared, error) {
	tmpl, err := h.tmpl.lookup(h, p.template)
	if err != nil {
		return nil, err
	}
	id := ids.NewID()
	spec := wall.Spec{ID: id, Hostname: ids.Hostname(id), Template: tmpl, DiskBytes: DefaultDisk, ShmBytes: DefaultShm}
	sb, err := prep.Prepare(ctx, spec, true)
	if err != nil || !hasStartCommand(tmpl) {
		return sb, err
	}
	p.started.Store(true)
	// Until a create takes it, the sandbox may reach nothing; it has an
	// interface so that a create that asks for a network can be given one.
	spec.Token = ids.NewToken()
	spec.Limits.MemoryBytes, spec.Limits.CPUs, spec.Limits.Pids = DefaultMemory, DefaultCPUs, DefaultPids+inside.AgentThreads
	spec.Env = tmpl.EnvWith(nil)
	spec.NetPolicy = network.Policy{Mode: network.Allowlist}
	if spec.Net, err = h.net.get(h, spec.NetPolicy); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	if err := sb.Start(spec); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	if err := startCommand(sb, tmpl); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	return &startedSandbox{Prepared: sb}, nil
}

func hasStartCommand(t *template.Template) bool {
	return t != nil && t.Image != nil && !t.Build && t.Image.Info.Config.Labels[LabelStart] != ""
}

// startedSandbox is a pooled sandbox already started, its start command
// run: Start applies only what a create may still change.
type startedSandbox struct{ wall.Prepared }

// Start applies spec's limits and network policy (fits checked the rest).
func (s *startedSandbox) Start(spec wall.Spec) error {
	if cg := s.Cgroup(); cg != nil {
		if err := cg.Apply(spec.Limits); err != nil {
			return err
		}
	}
	if n := s.Network(); n != nil {
		return n.SetPolicy(spec.NetPolicy)
	}
	return nil
}

// ranStartCommand is true: Pending.Start does not run it again.
func (s *startedSandbox) ranStartCommand() bool { return true }

func (h *Host) poolTemplate() string {
	if h.PoolTemplate == "" {
		return "host"
	}
	return h.PoolTemplate
}

// fits says whether a started sandbox can serve a create of o: what it was
// started with and cannot change (disk and shm sizes, environment, whether
// it has a network interface) is what o asks for.
func fits(o *Options) bool {
	return o.Disk == DefaultDisk && o.Shm == DefaultShm && len(o.Env) == 0 && o.MaxOutput == 0 && o.Net.Networked()
}

// take hands out a sandbox made ahead for a create of o (template tmpl on
// wall w), if a pool keeps those and has one that fits.
func (ps *pools) take(w, tmpl string, o *Options) wall.Prepared {
	ps.mu.Lock()
	p := ps.byName[tmpl]
	ps.mu.Unlock()
	if p == nil || w != p.wall || (p.started.Load() && !fits(o)) {
		return nil
	}
	for {
		select {
		case sb := <-p.ch:
			if s, ok := sb.(*startedSandbox); ok {
				select {
				case <-s.Exited(): // its service died while it waited
					_ = s.Destroy()
					continue
				default:
				}
			}
			p.hits.Add(1)
			return sb
		default:
			ps.misses.Add(1)
			p.misses.Add(1)
			return nil
		}
	}
}

// PoolMisses counts the creates that found their pool empty.
func (h *Host) PoolMisses() int64 { return h.pool.misses.Load() }

// PoolStat is one pool as the daemon's metrics show it.
type PoolStat struct {
	Template, Wall string
	Ready, Size    int   // sandboxes ready now, and how many it keeps
	Hits, Misses   int64 // creates it served, and creates that found it empty
}

// PoolStats describes every pool.
func (h *Host) PoolStats() []PoolStat {
	ps := &h.pool
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]PoolStat, 0, len(ps.byName))
	for _, p := range ps.byName {
		out = append(out, PoolStat{Template: p.template, Wall: p.wall, Ready: len(p.ch), Size: cap(p.ch),
			Hits: p.hits.Load(), Misses: p.misses.Load()})
	}
	return out
}

func (ps *pools) stop() {
	ps.mu.Lock()
	all := ps.byName
	ps.byName = nil
	ps.mu.Unlock()
	for _, p := range all {
		p.cancel()
		<-p.done
		for len(p.ch) > 0 {
			_ = (<-p.ch).Destroy()
		}
	}
}
