package sandbox

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// pool keeps sandboxes prepared ahead of their request (forked into their
// namespaces and cgroups, runtime started, waiting for a spec) on the
// default wall, if its driver can prepare (wall.Preparer), so that a
// create only sends the request's part. Sandboxes tied to their caller
// (cage run) never come from it.
type pool struct {
	mu     sync.Mutex
	ch     chan wall.Prepared
	wall   string
	misses atomic.Int64 // creates that found the pool empty
	cancel context.CancelFunc
	done   chan struct{}
}

// refillPause is how long the pool waits after handing a sandbox out before
// it prepares the next (on a 2-core host a refill next to a create doubles
// the create's latency).
const refillPause = 10 * time.Millisecond

// StartPool keeps n sandboxes of PoolTemplate prepared on the default wall
// (process), if it can prepare them.
func (h *Host) StartPool(n int) {
	d, err := h.Driver("")
	prep, ok := d.(wall.Preparer)
	if n <= 0 || err != nil || !ok {
		return
	}
	p := &h.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ch != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.ch, p.wall, p.cancel, p.done = make(chan wall.Prepared, n), d.Name(), cancel, make(chan struct{})
	go p.fill(ctx, h, prep)
}

func (p *pool) fill(ctx context.Context, h *Host, prep wall.Preparer) {
	defer close(p.done)
	for ctx.Err() == nil {
		sb, err := h.prepare(ctx, prep)
		if err != nil {
			// A missing template (not built yet) is retried seldom.
			wait := time.Second
			if errors.Is(err, template.ErrNotFound) {
				wait = 30 * time.Second
			}
			h.Log.Warn("pool: prepare a sandbox", "template", h.poolTemplate(), "err", err, "retry in", wait)
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
			continue
		}
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
// (Start resizes), at background CPU priority.
func (h *Host) prepare(ctx context.Context, prep wall.Preparer) (wall.Prepared, error) {
	tmpl, err := h.tmpl.lookup(h, h.poolTemplate())
	if err != nil {
		return nil, err
	}
	id := ids.NewID()
	return prep.Prepare(ctx, wall.Spec{ID: id, Hostname: ids.Hostname(id), Template: tmpl,
		DiskBytes: DefaultDisk, ShmBytes: DefaultShm}, true)
}

func (h *Host) poolTemplate() string {
	if h.PoolTemplate == "" {
		return "host"
	}
	return h.PoolTemplate
}

// take hands out a prepared sandbox for a create of template tmpl on wall
// w, if the pool keeps those and has one.
func (p *pool) take(h *Host, w, tmpl string) wall.Prepared {
	p.mu.Lock()
	ch, pw := p.ch, p.wall
	p.mu.Unlock()
	if ch == nil || w != pw || tmpl != h.poolTemplate() {
		return nil
	}
	select {
	case sb := <-ch:
		return sb
	default:
		p.misses.Add(1)
		return nil
	}
}

// PoolMisses counts the creates that found the pool empty.
func (h *Host) PoolMisses() int64 { return h.pool.misses.Load() }

func (p *pool) stop() {
	p.mu.Lock()
	ch, cancel, done := p.ch, p.cancel, p.done
	p.mu.Unlock()
	if ch == nil {
		return
	}
	cancel()
	<-done
	for {
		select {
		case sb := <-ch:
			_ = sb.Destroy()
		default:
			return
		}
	}
}
