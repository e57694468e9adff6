// Package sandbox creates sandboxes from user-facing options: it validates
// them once, builds the one wall.Spec a driver makes a sandbox from, and
// owns the host's services every wall shares: the registry of walls
// (walls.go, the one table of drivers), templates (templates.go), the
// sandbox network (network.go) and the pools of prepared sandboxes, one per
// wall and template (pool.go).
// The CLI's `cage run` uses it directly; the daemon puts its state machine
// and store on top.
package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/rocache"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// Host is what creating sandboxes on this machine needs. Set its exported
// fields before the first sandbox; the walls are made from them then.
type Host struct {
	RunDir    string // runtime state, e.g. /run/cage
	AgentPath string
	Cgroups   *cgroups.Manager
	Log       *slog.Logger
	// Templates is the template store (nil: only the built-in "host").
	Templates *imgstore.Store
	// PoolTemplate is the template the pool prepares sandboxes of ("" is
	// host); creates of other templates are not pooled.
	PoolTemplate string
	// PoolGrow lets a pool keep up to PoolGrow times its size while creates
	// find it empty, back to its size once none came for poolIdle (0 or 1:
	// a pool keeps its size).
	PoolGrow int
	// PoolIdle is how long a pool grown by demand waits without a create
	// before it shrinks back, one member per sweep (0: a minute).
	PoolIdle time.Duration
	// NetConfig configures sandbox networks, set up at the first sandbox
	// that has one.
	NetConfig network.Config
	// KernelDir is where the microvm wall's guest kernel is ("": KernelDir()).
	KernelDir string
	// SpawnAgents starts the process wall's agents from a helper process
	// (package spawner) rather than by forking this one: for a long-lived
	// process whose memory grows with its sandboxes (the daemon).
	SpawnAgents bool

	wallsOnce sync.Once
	walls     map[string]wall.Driver

	fullGCs atomic.Int64 // GCs that did the host-wide scans

	tmpl templates
	net  networks
	pool pools
}

// NewHost checks that this host can run sandboxes at all (root, the
// kernel's namespaces, cgroups) and returns what is needed to create them.
// agentPath may be empty: cage-agent is then looked for beside the running
// executable.
func NewHost(runDir, agentPath string, log *slog.Logger) (*Host, error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: cage needs root to create sandboxes (user namespaces with private uid ranges and cgroup limits); run it with sudo", ErrPermission)
	}
	if agentPath == "" {
		var err error
		if agentPath, err = FindAgent(); err != nil {
			return nil, err
		}
	}
	if err := checkKernel(); err != nil {
		return nil, err
	}
	cg, err := cgroups.Detect("cage")
	if err != nil {
		return nil, fmt.Errorf("%w: cgroups: %v", ErrUnavailable, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Host{RunDir: runDir, AgentPath: agentPath, Cgroups: cg, Log: log}, nil
}

// FindAgent locates cage-agent: $CAGE_AGENT, else beside the executable.
func FindAgent() (string, error) {
	if p := os.Getenv("CAGE_AGENT"); p != "" {
		return p, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	p := filepath.Join(filepath.Dir(exe), "cage-agent")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%w: cage-agent not found beside %s (build both with `make`, or set CAGE_AGENT)", ErrUnavailable, exe)
	}
	return p, nil
}

// checkKernel probes the kernel features every wall needs on the host.
func checkKernel() error {
	for _, ns := range []string{"user", "pid", "mnt", "ipc", "uts", "net", "cgroup"} {
		if _, err := os.Stat("/proc/self/ns/" + ns); err != nil {
			return fmt.Errorf("%w: the kernel lacks %s namespaces (CONFIG_%s_NS)", ErrUnavailable, ns, nsConfig[ns])
		}
	}
	return nil
}

var nsConfig = map[string]string{"user": "USER", "pid": "PID", "mnt": "NAMESPACES", "ipc": "IPC", "uts": "UTS", "net": "NET", "cgroup": "CGROUP"}

// Pending is a sandbox about to start: validated, named (its id and token
// are known), its template resolved, possibly prepared ahead by the pool.
// The daemon records it before Start runs anything, so that a crash leaves
// a record to clean up.
type Pending struct {
	h        *Host
	driver   wall.Driver
	spec     wall.Spec
	prepared wall.Prepared // from the pool, or nil
}

// ID is the sandbox's id.
func (p *Pending) ID() string { return p.spec.ID }

// Spec is what the sandbox will be made from.
func (p *Pending) Spec() wall.Spec { return p.spec }

// Begin validates o and names the sandbox; nothing runs yet. o gets its
// defaults filled.
func (h *Host) Begin(ctx context.Context, o *Options) (*Pending, error) {
	d, err := h.Driver(o.Wall)
	if err != nil {
		return nil, err
	}
	if err := volumesOn(d, o.Volumes); err != nil {
		return nil, err
	}
	if err := d.Missing(); err != nil {
		return nil, err
	}
	o.Wall = d.Name()
	if o.Template == "" {
		o.Template = h.DefaultTemplate(d.Name())
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	tmpl, err := h.tmpl.lookup(h, o.Template, o.BuildStep)
	if err != nil {
		return nil, err
	}
	if o.Run != nil {
		if _, ok := d.(wall.OneShotRunner); !ok || hasStartCommand(tmpl) || o.Run.Size() > wall.MaxRunSize {
			return nil, ErrNoOneShot
		}
	}
	netHost, err := h.net.get(h, o.Net)
	if err != nil {
		return nil, err
	}
	p := &Pending{h: h, driver: d}
	p.spec = wall.Spec{Template: tmpl,
		Limits:    cgroups.Limits{MemoryBytes: o.Memory, CPUs: o.CPUs, Pids: o.Pids + inside.AgentThreads},
		DiskBytes: o.Disk, ShmBytes: o.Shm, Env: tmpl.EnvWith(o.Env), MaxOutput: o.MaxOutput,
		DieWithCaller: o.DieWithCaller, Net: netHost, NetPolicy: o.Net, Volumes: o.Volumes, Run: o.Run}
	if !o.DieWithCaller && o.ID == "" && len(o.Volumes) == 0 && o.Run == nil {
		p.prepared = h.pool.take(d.Name(), o, p.spec) // (prepared roots have no volumes)
	}
	id, token := o.ID, o.Token
	if p.prepared != nil {
		id = p.prepared.ID()
		if t := p.prepared.Token(); t != "" {
			token = t // a started sandbox from the pool has its own
		}
	}
	if id == "" {
		id = ids.NewID()
	}
	if token == "" {
		token = ids.NewToken()
	}
	p.spec.ID, p.spec.Token, p.spec.Hostname = id, token, ids.Hostname(id)
	return p, nil
}

// foreground puts a pool's member made at background priority (a
// microVM's QEMU) back to the normal one: its take does, not its Start,
// which a pool may call itself to warm the member up.
func foreground(sb wall.Prepared) {
	if s, ok := sb.(*startedSandbox); ok {
		sb = s.Prepared
	}
	if f, ok := sb.(interface{ Foreground() }); ok {
		f.Foreground()
	}
}

// Start makes the sandbox (or starts the prepared one) and runs its
// template's start command. On error nothing is left behind. A prepared
// sandbox built from an older copy of its template's files is destroyed
// and wall.ErrStale returned: the caller begins again.
func (p *Pending) Start(ctx context.Context) (wall.Sandbox, error) {
	var sb wall.Sandbox
	var err error
	if p.prepared != nil {
		foreground(p.prepared)
		sb, err = p.prepared, p.prepared.Start(p.spec)
	} else {
		sb, err = p.driver.Create(ctx, p.spec)
	}
	if s, ok := sb.(interface{ ranStartCommand() bool }); err == nil && !(ok && s.ranStartCommand()) {
		err = startCommand(sb, p.spec.Template)
	}
	if err != nil {
		if sb != nil {
			_ = sb.Destroy()
		}
		return nil, err
	}
	if s, ok := sb.(*startedSandbox); ok {
		sb = s.Prepared // the wall's own, with its abilities (wall.Checkpointable...)
	}
	return sb, nil
}

// Abort gives up a pending sandbox that will not start.
func (p *Pending) Abort() {
	if p.prepared != nil {
		_ = p.prepared.Destroy()
	}
}

// Create begins and starts a sandbox at once (cage run, tests); a stale
// prepared sandbox is replaced by a fresh one.
func (h *Host) Create(ctx context.Context, o Options) (wall.Sandbox, error) {
	for attempt := 0; ; attempt++ {
		p, err := h.Begin(ctx, &o)
		if err != nil {
			return nil, err
		}
		sb, err := p.Start(ctx)
		if errors.Is(err, wall.ErrStale) && attempt < 8 {
			continue
		}
		return sb, err
	}
}

// Adopt takes charge of a running sandbox another process created, on the
// wall its record names.
func (h *Host) Adopt(wallName string, a wall.Adoption) (wall.Sandbox, error) {
	d, err := h.Driver(wallName)
	if err != nil {
		return nil, err
	}
	return d.Adopt(a)
}

// GC removes the leftovers of sandboxes whose owner died (see state.GC)
// and of their networks.
func (h *Host) GC() { h.gc(true) }

// GCBesideRun is the GC each `cage run` does beside its command: the
// state directories of dead sandboxes always (what a killed run left is
// collected by the next run once it is orphanGrace old), the host-wide
// scans (uid-range locks nobody holds, links and rules of slots nobody
// holds) when that found a dead sandbox, and otherwise once every
// fullGCEvery in the run directory. Those scans read every live
// sandbox's lock and the host's every link and rule, and with a daemon's
// 200 sandboxes alive on the host they were most of a run's GC (measured
// 2026-12-05: the GC 77-82 ms of a 155 ms run, on 2 loaded CPUs); what
// they find without a dead state directory beside it is a crash's within
// a teardown (or a link made by hand), which waits for the next full one.
func (h *Host) GCBesideRun() { h.gc(false) }

// fullGCEvery is how often runs in one run directory do GC's host-wide
// scans when no dead sandbox calls for them (GCBesideRun).
const fullGCEvery = 30 * time.Second

// fullGCStamp names the file in the run directory whose time says when a
// run last did GC's host-wide scans.
const fullGCStamp = "gc-full"

func (h *Host) gc(full bool) {
	defer PruneIfIdle(h.RunDir)
	ids, err := state.GCDirs(h.RunDir, h.Cgroups)
	if err != nil {
		h.Log.Warn("gc", "err", err)
	} else if len(ids) > 0 {
		h.Log.Info("gc: removed the leftovers of dead sandboxes", "sandboxes", ids)
	}
	stamp := filepath.Join(h.RunDir, fullGCStamp)
	if !full && len(ids) == 0 {
		if fi, err := os.Lstat(stamp); err == nil && fi.Mode().IsRegular() && time.Since(fi.ModTime()) < fullGCEvery {
			return
		}
	}
	// Stamped first: runs that start together do one full GC, not one each.
	now := time.Now()
	if err := os.Chtimes(stamp, now, now); errors.Is(err, os.ErrNotExist) {
		_ = os.WriteFile(stamp, nil, 0o600)
	}
	h.fullGCs.Add(1)
	state.GCIDLocks()
	h.net.gc(h)
}

// PruneIfIdle prunes the read-only copies sandboxes share (the host
// template's /etc, the agent's binary) down to the newest of each, when no
// sandbox is left under runDir: a running sandbox keeps using the copy it
// started with, and a replaced agent or /etc leaves its old copy behind.
func PruneIfIdle(runDir string) {
	if ents, err := os.ReadDir(filepath.Join(runDir, "sandboxes")); err == nil && len(ents) == 0 {
		template.PruneCaches(filepath.Join(runDir, "templates"))
		rocache.Prune(filepath.Join(runDir, "agents"), "")
	}
}

// Close stops the pool, destroys the sandboxes waiting in it, and stops
// the network's resolver.
func (h *Host) Close() {
	h.pool.stop()
	h.net.close()
}
