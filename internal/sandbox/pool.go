package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
)

// pools keep sandboxes made ahead of their request, one pool per (wall,
// template), on every wall whose driver can prepare (wall.Preparer: the
// process wall forks its agent into its namespaces and cgroups; runc and
// gVisor start the container with its agent waiting for the request's
// part of its spec; microvm restores a VM whose guest waits for its
// identity), so that a create only sends the request's part. Every
// member is made with a fresh id (and so hostname) of its own, default
// sizes and limits, and, where the wall fixes it at preparation, a network
// interface under a policy that allows nothing, or none: which of the two
// follows the creates the pool last saw (demand). A create takes a member
// that fits it (wall.Fitter), and a member made from what is no longer
// current (wall.Staler: the template imported again, the agent, kernel or
// runtime changed) is destroyed, never handed out, as the pool finds it
// at a take or at its sweep (every sweepEvery).
//
// A pool is sized by configuration and by demand: each create that finds
// it empty makes it keep one more (up to Host.PoolGrow times its
// configured size), so that the next burst of creates finds as many ready
// as the last one missed; once no create has come for poolIdle, its sweeps
// destroy what it keeps beyond its configured size, one at a time.
//
// A template with a start command gets started sandboxes whose start
// command has run and passed its ready check (code-interpreter-v1: its
// Python kernel is up), with the pool's fresh id and token, the default
// sizes and no environment of the request's; a create takes one only when
// it asks for nothing it cannot be given after the start (see fits), and
// gets its limits and network policy applied. Sandboxes tied to their
// caller (cage run) never come from a pool.
type pools struct {
	mu     sync.Mutex
	byName map[string]*pool // by poolKey
	misses atomic.Int64     // creates that found their pool empty
}

type pool struct {
	template string
	wall     string
	prep     wall.Preparer
	fixesNet bool         // the wall gives members their network as it prepares them
	warm     bool         // members are started and run a command first (wall.Warmer)
	started  atomic.Bool  // its sandboxes are started (the template has a start command)
	wantNet  atomic.Bool  // make members with a network interface (where the wall fixes it)
	hits     atomic.Int64 // creates it served
	misses   atomic.Int64 // creates that found it empty
	stale    atomic.Int64 // members destroyed unused as stale
	floor    int          // the size it was configured with
	idle     time.Duration
	size     atomic.Int32 // how many it keeps now: floor, more after misses
	lastTake atomic.Int64 // when a create last asked it (unix nanoseconds)
	ch       chan wall.Prepared
	room     chan struct{} // a token per place free in ch: fill prepares only into room
	cancel   context.CancelFunc
	done     chan struct{}
}

// refillPause is how long a pool waits after handing a sandbox out before
// it prepares the next (on a 2-core host a refill next to a create doubles
// the create's latency).
const refillPause = 10 * time.Millisecond

// sweepEvery is how often a full pool looks for members gone stale or dead.
var sweepEvery = 2 * time.Second

// poolIdle is how long a pool grown by demand waits without a create
// before it shrinks back, one member per sweep (Host.PoolIdle, when set).
const poolIdle = time.Minute

func poolKey(wallName, tmpl string) string { return wallName + "/" + tmpl }

// PoolOf splits a pool's name in configuration, TEMPLATE (on the default
// wall) or WALL/TEMPLATE (template names hold no slash).
func PoolOf(key string) (wallName, tmpl string) {
	if w, t, ok := strings.Cut(key, "/"); ok {
		return w, t
	}
	return "", key
}

// CheckPool says what is wrong with a pool's name in configuration (see
// PoolOf): an unknown wall, or no template.
func CheckPool(key string) error {
	w, t := PoolOf(key)
	if t == "" || strings.Contains(t, "/") {
		return fmt.Errorf("%w: pool %q: want TEMPLATE or WALL/TEMPLATE", ErrInvalid, key)
	}
	if w != "" && !slices.Contains(Walls, w) {
		return fmt.Errorf("%w: pool %q: unknown wall %q (walls: %v)", ErrInvalid, key, w, Walls)
	}
	return nil
}

// StartPool keeps n sandboxes of PoolTemplate prepared on the default wall
// (process), if it can prepare them.
func (h *Host) StartPool(n int) { h.AddPool(h.poolTemplate(), n) }

// AddPool keeps n sandboxes of template name ready on the default wall (see
// pools); a second call for the same template changes nothing.
func (h *Host) AddPool(name string, n int) { _ = h.AddWallPool("", name, n) }

// AddWallPool keeps n sandboxes of template name ready on wall wallName
// ("": the default wall). It says why when the wall cannot keep a pool
// here (unknown, missing on this host, or unable to prepare); a second
// call for the same wall and template changes nothing.
func (h *Host) AddWallPool(wallName, name string, n int) error {
	if n <= 0 {
		return nil
	}
	d, err := h.Driver(wallName)
	if err != nil {
		return err
	}
	prep, ok := d.(wall.Preparer)
	if !ok {
		return errors.New("the " + d.Name() + " wall cannot prepare sandboxes")
	}
	if err := d.Missing(); err != nil {
		return err
	}
	ps := &h.pool
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.byName == nil {
		ps.byName = map[string]*pool{}
	}
	key := poolKey(d.Name(), name)
	if ps.byName[key] != nil {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	most := n * max(1, h.PoolGrow)
	idle := h.PoolIdle
	if idle <= 0 {
		idle = poolIdle
	}
	p := &pool{template: name, wall: d.Name(), prep: prep, floor: n, idle: idle, ch: make(chan wall.Prepared, most),
		room: make(chan struct{}, most), cancel: cancel, done: make(chan struct{})}
	p.size.Store(int32(n))
	for range n {
		p.room <- struct{}{}
	}
	if w, ok := d.(wall.Warmer); ok && w.WarmsUp() {
		p.warm = true
	}
	if np, ok := d.(wall.NetPreparer); ok && np.PreparesNetwork() {
		// Until creates say otherwise, members have a network interface
		// where the host has a network: E2B's SDKs ask for one by default.
		p.fixesNet = true
		if _, err := h.net.get(h, network.Policy{Mode: network.Allowlist}); err == nil {
			p.wantNet.Store(true)
		}
	}
	ps.byName[key] = p
	go p.fill(ctx, h)
	return nil
}

func (p *pool) fill(ctx context.Context, h *Host) {
	defer close(p.done)
	wait := time.Second
	sweep := time.NewTicker(sweepEvery)
	defer sweep.Stop()
	for ctx.Err() == nil {
		// Prepare only into a free place: what a sandbox is made with
		// (the template's files, a network interface or none) is what is
		// current as it is put in, not when the pool was last full.
	room:
		for {
			select {
			case <-p.room:
				break room
			case <-sweep.C:
				p.sweep(h)
			case <-ctx.Done():
				return
			}
		}
		// A place is often freed by a take: let the create that took the
		// sandbox use the CPU before preparing the next.
		select {
		case <-time.After(refillPause):
		case <-ctx.Done():
		}
		sb, err := h.prepare(ctx, p)
		if err != nil && ctx.Err() != nil {
			return // stopped while preparing: nothing to say
		}
		if err != nil {
			p.free()
			// A missing template (not built yet) is retried seldom, a
			// failing start command less and less often.
			if errors.Is(err, template.ErrNotFound) {
				wait = 30 * time.Second
			}
			h.Log.Warn("pool: prepare a sandbox", "template", p.template, "wall", p.wall, "err", err, "retry in", wait)
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
			wait = min(2*wait, time.Minute)
			continue
		}
		wait = time.Second
		p.ch <- sb // (room was taken for it)
	}
}

// sweep destroys the members that died or went stale while they waited
// (the template imported again, the agent, kernel or runtime changed), and
// one beyond the configured size once no create has come for poolIdle.
func (p *pool) sweep(h *Host) {
	p.shrink()
	tmpl, err := h.tmpl.lookup(h, p.template, false)
	if err != nil && !errors.Is(err, template.ErrNotFound) {
		return // cannot tell now
	}
	for n := len(p.ch); n > 0; n-- {
		var sb wall.Prepared
		select {
		case sb = <-p.ch:
		default:
			return
		}
		if gone(sb) {
			_ = sb.Destroy()
			p.free()
			continue
		}
		if s, ok := sb.(wall.Staler); ok && (tmpl == nil || s.Stale(tmpl)) {
			p.stale.Add(1)
			_ = sb.Destroy()
			p.free()
			continue
		}
		p.ch <- sb // (its place stayed taken)
	}
}

// grow makes the pool keep one more, up to cap(p.ch): a create found it
// empty.
func (p *pool) grow() {
	for {
		n := p.size.Load()
		if int(n) >= cap(p.ch) {
			return
		}
		if p.size.CompareAndSwap(n, n+1) {
			p.free() // a new place
			return
		}
	}
}

// shrink destroys one member beyond the configured size once no create has
// asked the pool for p.idle; its place goes with it.
func (p *pool) shrink() {
	if int(p.size.Load()) <= p.floor || time.Since(time.Unix(0, p.lastTake.Load())) < p.idle {
		return
	}
	select {
	case sb := <-p.ch:
		p.size.Add(-1)
		_ = sb.Destroy()
	default:
	}
}

// free gives back the place of a sandbox taken out for good.
func (p *pool) free() {
	select {
	case p.room <- struct{}{}:
	default:
	}
}

func gone(sb wall.Sandbox) bool {
	select {
	case <-sb.Exited():
		return true
	default:
		return false
	}
}

// prepare makes one sandbox of the pool's template with the default sizes
// and limits (Start changes them where the wall can), at background CPU
// priority; for a template with a start command, it starts it too and
// waits for its ready check.
func (h *Host) prepare(ctx context.Context, p *pool) (wall.Prepared, error) {
	tmpl, err := h.tmpl.lookup(h, p.template, false)
	if err != nil {
		return nil, err
	}
	id := ids.NewID()
	spec := wall.Spec{ID: id, Hostname: ids.Hostname(id), Template: tmpl, DiskBytes: DefaultDisk, ShmBytes: DefaultShm}
	spec.Limits.MemoryBytes, spec.Limits.CPUs, spec.Limits.Pids = DefaultMemory, DefaultCPUs, DefaultPids+inside.AgentThreads
	started := hasStartCommand(tmpl)
	if started || (p.fixesNet && p.wantNet.Load()) {
		// Until a create takes it, the sandbox may reach nothing.
		spec.NetPolicy = network.Policy{Mode: network.Allowlist}
		if spec.Net, err = h.net.get(h, spec.NetPolicy); err != nil {
			return nil, err
		}
	}
	sb, err := p.prep.Prepare(ctx, spec, true)
	if err != nil || !(started || p.warm) {
		return sb, err
	}
	if started {
		p.started.Store(true)
	}
	spec.Token = ids.NewToken()
	spec.Env = tmpl.EnvWith(nil)
	if err := sb.Start(spec); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	if started {
		err = startCommand(sb, tmpl)
	} else {
		err = warmUp(ctx, sb)
	}
	if err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	_, fixed := sb.(wall.Fitter)
	return &startedSandbox{Prepared: sb, spec: spec, fixedLimits: fixed, netKind: !started && p.fixesNet}, nil
}

// warmUp runs commands in a started sandbox through the agent, as a
// create's first commands would (a program found on the PATH, and E2B's
// bash -l -c, where the template has bash), so that the first command of
// the create that takes it finds its path warm (see wall.Warmer).
func warmUp(ctx context.Context, sb wall.Sandbox) error {
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if _, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"warm"}, Stdout: io.Discard, Stderr: io.Discard}); err != nil {
		return fmt.Errorf("warm up: %w", err)
	}
	// (A template without bash fails this one: nothing to warm.)
	_, _ = c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/bash", Args: []string{"-l", "-c", "true"}, Stdout: io.Discard, Stderr: io.Discard})
	return nil
}

func hasStartCommand(t *template.Template) bool {
	return t != nil && t.Image != nil && !t.Build && t.Image.Info.Config.Labels[LabelStart] != ""
}

// startedSandbox is a pooled sandbox already started, its start command
// run: Start applies only what a create may still change.
type startedSandbox struct {
	wall.Prepared
	spec        wall.Spec // what it was started with
	fixedLimits bool      // its wall fixed its limits at the start (a VM's)
	netKind     bool      // it serves only creates with its network interface, or without
}

// Start applies spec's limits and network policy (fits checked the rest).
func (s *startedSandbox) Start(spec wall.Spec) error {
	if cg := s.Cgroup(); cg != nil && spec.Limits != s.spec.Limits {
		if err := cg.Apply(spec.Limits); err != nil {
			return err
		}
	}
	if n := s.Network(); n != nil {
		return n.SetPolicy(spec.NetPolicy)
	}
	return nil
}

// Fits: a wall that fixed the sandbox's limits at its start serves only
// creates with the same, and one that fixed its network interface, or
// none, creates of that kind (fits checked the rest).
func (s *startedSandbox) Fits(spec wall.Spec) bool {
	networked := spec.Net != nil && spec.NetPolicy.Networked()
	return (!s.fixedLimits || spec.Limits == s.spec.Limits) && (!s.netKind || networked == (s.Network() != nil))
}

// Stale is the started sandbox's own (see wall.Staler).
func (s *startedSandbox) Stale(t *template.Template) bool {
	st, ok := s.Prepared.(wall.Staler)
	return ok && st.Stale(t)
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
// started with and cannot change (disk and shm sizes, environment, and
// for one whose start command ran, a network interface) is what o asks
// for.
func fits(o *Options, needNet bool) bool {
	return o.Disk == DefaultDisk && o.Shm == DefaultShm && len(o.Env) == 0 && o.MaxOutput == 0 && (!needNet || o.Net.Networked())
}

// take hands out a sandbox made ahead for a create of o on wall w (spec:
// what Begin built, without id and token yet), if a pool keeps those and
// has one that fits. It destroys the members it finds dead or stale, and
// those without the network interface (or with one) that creates now ask
// for, so that the pool makes what is asked.
func (ps *pools) take(w string, o *Options, spec wall.Spec) wall.Prepared {
	ps.mu.Lock()
	p := ps.byName[poolKey(w, spec.Template.Name)]
	ps.mu.Unlock()
	if p == nil || ((p.started.Load() || p.warm) && !fits(o, p.started.Load())) {
		return nil
	}
	p.lastTake.Store(time.Now().UnixNano())
	networked := spec.Net != nil && spec.NetPolicy.Networked()
	if p.fixesNet && !p.started.Load() {
		p.wantNet.Store(networked)
	}
	var kept []wall.Prepared
	defer func() {
		for _, sb := range kept {
			p.ch <- sb // (their places stayed taken)
		}
	}()
	for n := len(p.ch); n > 0; n-- {
		var sb wall.Prepared
		select {
		case sb = <-p.ch:
		default:
			n = 0
			continue
		}
		if gone(sb) { // died while it waited
			_ = sb.Destroy()
			p.free()
			continue
		}
		if s, ok := sb.(wall.Staler); ok && s.Stale(spec.Template) {
			p.stale.Add(1)
			_ = sb.Destroy()
			p.free()
			continue
		}
		if f, ok := sb.(wall.Fitter); ok && !f.Fits(spec) {
			if p.fixesNet && !p.started.Load() && (sb.Network() != nil) != networked {
				_ = sb.Destroy() // creates now ask for the other kind
				p.free()
			} else {
				kept = append(kept, sb)
			}
			continue
		}
		p.hits.Add(1)
		p.free()
		return sb
	}
	ps.misses.Add(1)
	p.misses.Add(1)
	if len(kept) == 0 {
		p.grow() // (members that fit other creates do not make it grow)
	}
	return nil
}

// PoolMisses counts the creates that found their pool empty.
func (h *Host) PoolMisses() int64 { return h.pool.misses.Load() }

// PoolStat is one pool as the daemon's metrics show it.
type PoolStat struct {
	Template, Wall string
	Ready, Size    int   // sandboxes ready now, and how many it keeps now
	Floor, Max     int   // its configured size, and the most demand grows it to
	Hits, Misses   int64 // creates it served, and creates that found it empty
	Stale          int64 // sandboxes it destroyed unused, made from what is no longer current
}

// PoolStats describes every pool.
func (h *Host) PoolStats() []PoolStat {
	ps := &h.pool
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]PoolStat, 0, len(ps.byName))
	for _, p := range ps.byName {
		out = append(out, PoolStat{Template: p.template, Wall: p.wall, Ready: len(p.ch), Size: int(p.size.Load()),
			Floor: p.floor, Max: cap(p.ch),
			Hits: p.hits.Load(), Misses: p.misses.Load(), Stale: p.stale.Load()})
	}
	return out
}

// StopPools stops every pool and destroys the sandboxes waiting in them;
// pools added later start afresh.
func (h *Host) StopPools() { h.pool.stop() }

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
