// Package sandbox creates sandboxes from user-facing options: it validates
// limits, applies defaults, checks that the host can do it, and hands the
// result to a wall. The CLI's `cage run` uses it directly; the daemon will
// put its state machine and store on top.
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
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/units"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/oci"
	"github.com/cagehq/cage/internal/wall/process"
	"github.com/cagehq/cage/internal/wall/state"
)

// Error kinds; callers map them to exit codes and HTTP statuses at the edge.
var (
	ErrInvalid     = errors.New("invalid")
	ErrNotFound    = template.ErrNotFound
	ErrPermission  = errors.New("permission denied")
	ErrUnavailable = errors.New("unavailable on this host")
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
}

// Validate fills defaults and rejects limits that are malformed, too small
// or above the maxima.
func (o *Options) Validate() error {
	if o.Template == "" {
		o.Template = "host"
		if o.Wall == "microvm" {
			o.Template = MicroVMTemplate
		}
	}
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
	case o.CPUs < MinCPUs:
		return fmt.Errorf("%w: cpus %g is too small (at least %g)", ErrInvalid, o.CPUs, MinCPUs)
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
	return nil
}

// identify gives o a fresh sandbox id and access token where it has none.
func (o *Options) identify() {
	if o.ID == "" {
		o.ID = ids.NewID()
	}
	if o.Token == "" {
		o.Token = ids.NewToken()
	}
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

// Host is what creating sandboxes on this machine needs.
type Host struct {
	RunDir string // runtime state, e.g. /run/cage
	// Templates is the template store (nil: only the built-in "host").
	Templates *imgstore.Store
	tmplMu    sync.Mutex
	extra     map[string]*template.Template // see SetTemplate
	// PoolTemplate is the template the pool prepares sandboxes of ("" is
	// host); creates of other templates are not pooled.
	PoolTemplate string
	AgentPath    string
	Cgroups      *cgroups.Manager
	Log          *slog.Logger
	// Runtimes are the OCI walls this host has (by wall name).
	Runtimes map[string]*oci.Runtime
	// NetConfig configures sandbox networks, set up at the first sandbox
	// that has one.
	NetConfig network.Config

	netMu sync.Mutex
	net   *network.Host

	// KernelDir is where the microvm wall's guest kernel is ("": KernelDir()).
	KernelDir   string
	kernelOnce  sync.Once
	guestKernel *vm.Kernel
	kernelErr   error
	accelOnce   sync.Once
	accel       string
	accelWhy    string

	pool       chan *process.Sandbox // prepared sandboxes, when a pool runs
	PoolMisses atomic.Int64          // creates that found the pool empty
	stopPool   context.CancelFunc
	poolDone   chan struct{}
}

// NewHost checks that this host can run process-wall sandboxes and returns
// what is needed to create them. agentPath may be empty: cage-agent is then
// looked for beside the running executable.
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
	return &Host{RunDir: runDir, AgentPath: agentPath, Cgroups: cg, Log: log, Runtimes: ProbeRuntimes()}, nil
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

// checkKernel probes the kernel features the process wall cannot do without.
func checkKernel() error {
	for _, ns := range []string{"user", "pid", "mnt", "ipc", "uts", "net", "cgroup"} {
		if _, err := os.Stat("/proc/self/ns/" + ns); err != nil {
			return fmt.Errorf("%w: the kernel lacks %s namespaces (CONFIG_%s_NS)", ErrUnavailable, ns, nsConfig[ns])
		}
	}
	return nil
}

var nsConfig = map[string]string{"user": "USER", "pid": "PID", "mnt": "NAMESPACES", "ipc": "IPC", "uts": "UTS", "net": "NET", "cgroup": "CGROUP"}

// Create starts a sandbox on the process wall.
func (h *Host) Create(ctx context.Context, o Options) (wall.Sandbox, error) {
	if o.Wall == "microvm" {
		return h.createMicroVM(ctx, o)
	}
	if o.Wall != "" && o.Wall != "process" {
		return h.createOCI(ctx, o)
	}
	sb, err := h.Prepare(ctx, &o)
	if err != nil {
		return nil, err
	}
	err = h.Start(sb, o)
	if errors.Is(err, process.ErrStale) {
		// A pooled sandbox older than its template's files: start afresh.
		_ = sb.Destroy()
		o.ID = ""
		if sb, err = h.prepareFresh(ctx, o); err == nil {
			err = h.Start(sb, o)
		}
	}
	if err != nil {
		if sb != nil {
			_ = sb.Destroy()
		}
		return nil, err
	}
	return sb, nil
}

// Prepare validates o (filling its defaults) and returns a sandbox ready to
// start: one from the pool when there is one, else a freshly forked one.
// Callers that record sandboxes (the daemon) learn its id here, before it
// runs anything.
func (h *Host) Prepare(ctx context.Context, o *Options) (*process.Sandbox, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if _, err := h.lookup(o.Template); err != nil {
		return nil, err
	}
	if sb := h.takePrepared(*o); sb != nil {
		return sb, nil
	}
	return h.prepareFresh(ctx, *o)
}

func (h *Host) prepareFresh(ctx context.Context, o Options) (*process.Sandbox, error) {
	cfg, err := h.config(o.DieWithCaller, o.Template, o.Disk, o.Shm)
	if err != nil {
		return nil, err
	}
	if o.ID != "" {
		cfg.ID = o.ID
	}
	return process.Prepare(ctx, cfg)
}

// Start starts a prepared sandbox with o's limits and template.
func (h *Host) Start(sb *process.Sandbox, o Options) error {
	tmpl, err := h.lookup(o.Template)
	if err != nil {
		return err
	}
	if o.Token == "" {
		o.Token = ids.NewToken()
	}
	netHost, err := h.network(o.Net)
	if err != nil {
		return err
	}
	err = sb.Start(process.Spec{
		Template:  tmpl,
		Limits:    cgroups.Limits{MemoryBytes: o.Memory, CPUs: o.CPUs, Pids: o.Pids + inside.AgentThreads},
		DiskBytes: o.Disk,
		ShmBytes:  o.Shm,
		Token:     o.Token,
		Env:       tmpl.EnvWith(o.Env),
		MaxOutput: o.MaxOutput,
		Net:       netHost,
		NetPolicy: o.Net,
	})
	if err != nil {
		return err
	}
	return startCommand(sb, tmpl)
}

// network returns the host's sandbox network when p needs one, setting it
// up the first time.
func (h *Host) network(p network.Policy) (*network.Host, error) {
	if !p.Networked() {
		return nil, nil
	}
	h.netMu.Lock()
	defer h.netMu.Unlock()
	if h.net != nil {
		return h.net, nil
	}
	cfg := h.NetConfig
	if cfg.Log == nil {
		cfg.Log = h.Log
	}
	if cfg.LockDir == "" {
		cfg.LockDir = h.RunDir
	}
	n, err := network.NewHost(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: sandbox network: %v", ErrUnavailable, err)
	}
	if removed := n.GC(state.SlotHeld); len(removed) > 0 {
		h.Log.Info("gc: removed the network of dead sandboxes", "slots", removed)
	}
	h.net = n
	return n, nil
}

// lookup resolves a template name: a template set with SetTemplate, or
// one of template.Lookup's.
func (h *Host) lookup(name string) (*template.Template, error) {
	h.tmplMu.Lock()
	t := h.extra[name]
	h.tmplMu.Unlock()
	if t != nil {
		return t, nil
	}
	return template.Lookup(name, filepath.Join(h.RunDir, "templates"), h.Templates)
}

// SetTemplate makes name resolve to t in this Host (nil: forget it): a
// template build runs its steps from templates that exist only here.
func (h *Host) SetTemplate(name string, t *template.Template) {
	h.tmplMu.Lock()
	defer h.tmplMu.Unlock()
	if h.extra == nil {
		h.extra = map[string]*template.Template{}
	}
	if t == nil {
		delete(h.extra, name)
	} else {
		h.extra[name] = t
	}
}

// Network is the host's sandbox network, nil until a sandbox had one.
func (h *Host) Network() *network.Host {
	h.netMu.Lock()
	defer h.netMu.Unlock()
	return h.net
}

// config is how to prepare a sandbox of template name with the given
// storage sizes (a pool uses the defaults; Start resizes).
func (h *Host) config(dieWithCaller bool, name string, disk, shm int64) (process.Config, error) {
	tmpl, err := h.lookup(name)
	if err != nil {
		return process.Config{}, err
	}
	return process.Config{
		ID:            ids.NewID(),
		AgentPath:     h.AgentPath,
		RunDir:        h.RunDir,
		Cgroups:       h.Cgroups,
		DieWithParent: dieWithCaller,
		Log:           h.Log,
		Spec:          process.Spec{Template: tmpl, DiskBytes: disk, ShmBytes: shm},
	}, nil
}

// GC removes the leftovers of sandboxes whose owner died (see process.GC).
func (h *Host) GC() {
	if ids, err := state.GC(h.RunDir, h.Cgroups); err != nil {
		h.Log.Warn("gc", "err", err)
	} else if len(ids) > 0 {
		h.Log.Info("gc: removed the leftovers of dead sandboxes", "sandboxes", ids)
	}
	if n := h.Network(); n != nil {
		if removed := n.GC(state.SlotHeld); len(removed) > 0 {
			h.Log.Info("gc: removed the network of dead sandboxes", "slots", removed)
		}
	} else if networkLeftovers() {
		// A process that died with networked sandboxes left interfaces or
		// rules behind, and this one has no network yet: setting it up
		// collects them (see network).
		if _, err := h.network(network.Policy{Mode: network.Internet}); err != nil {
			h.Log.Warn("gc: sandbox network", "err", err)
		}
	}
	if ents, err := os.ReadDir(filepath.Join(h.RunDir, "sandboxes")); err == nil && len(ents) == 0 {
		template.PruneCaches(filepath.Join(h.RunDir, "templates"))
	}
}

// networkLeftovers reports interfaces or nftables rules of sandbox slots
// that no live sandbox holds.
func networkLeftovers() bool {
	slots, _ := network.TableSlots()
	for _, slot := range append(slots, network.HostLinks()...) {
		if !state.SlotHeld(slot) {
			return true
		}
	}
	return false
}

// refillPause is how long the pool waits after handing a sandbox out before
// it prepares the next (on a 2-core host a refill next to a create doubles
// the create's latency).
const refillPause = 10 * time.Millisecond

// StartPool keeps n sandboxes prepared (forked into their namespaces and
// cgroups, runtime started, waiting for a spec), so that a create only sends
// the spec. Sandboxes tied to their caller (cage run) never come from it.
func (h *Host) StartPool(n int) {
	if n <= 0 || h.pool != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.pool, h.stopPool, h.poolDone = make(chan *process.Sandbox, n), cancel, make(chan struct{})
	go func() {
		defer close(h.poolDone)
		for ctx.Err() == nil {
			cfg, err := h.config(false, h.poolTemplate(), DefaultDisk, DefaultShm)
			var sb *process.Sandbox
			if err == nil {
				cfg.Background = true
				sb, err = process.Prepare(ctx, cfg)
			}
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
			case h.pool <- sb:
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
	}()
}

// Close stops the pool and destroys the sandboxes waiting in it, and stops
// the network's resolver.
func (h *Host) Close() {
	defer func() {
		h.netMu.Lock()
		if h.net != nil {
			h.net.Close()
			h.net = nil
		}
		h.netMu.Unlock()
	}()
	if h.pool == nil {
		return
	}
	h.stopPool()
	<-h.poolDone
	for {
		select {
		case sb := <-h.pool:
			_ = sb.Destroy()
		default:
			return
		}
	}
}

func (h *Host) poolTemplate() string {
	if h.PoolTemplate == "" {
		return "host"
	}
	return h.PoolTemplate
}

func (h *Host) takePrepared(o Options) *process.Sandbox {
	name := o.Template
	if name == "" {
		name = "host"
	}
	if h.pool == nil || o.DieWithCaller || o.ID != "" || name != h.poolTemplate() {
		return nil
	}
	select {
	case sb := <-h.pool:
		return sb
	default:
		h.PoolMisses.Add(1)
		return nil
	}
}

// AdoptNetwork takes over the network of an adopted sandbox (slot and
// policy as recorded when it was made).
func (h *Host) AdoptNetwork(sb wall.Sandbox, slot int, p network.Policy) error {
	n, err := h.network(p)
	if err != nil {
		return err
	}
	ns, err := n.Adopt(sb.ID(), slot, p)
	if err != nil {
		return fmt.Errorf("sandbox %s: network: %w", sb.ID(), err)
	}
	switch s := sb.(type) {
	case *process.Sandbox:
		s.SetNetwork(ns)
	case *oci.Sandbox:
		s.SetNetwork(ns)
	default:
		_ = ns.Close()
		return fmt.Errorf("sandbox %s: wall %s cannot adopt a network", sb.ID(), sb.Wall())
	}
	return nil
}

// Adopt takes charge of a running sandbox created by another process (see
// process.Adopt).
func (h *Host) Adopt(id, wallName string, pid int, startTime uint64, token string) (wall.Sandbox, error) {
	if wallName == "microvm" {
		// QEMU ends with the process that started it, and the session to
		// its agent with that process: there is nothing to adopt.
		return nil, fmt.Errorf("%w: a microvm sandbox ends with the process that created it", ErrUnavailable)
	}
	if wallName != "" && wallName != "process" {
		if err := h.WallMissing(wallName); err != nil {
			return nil, err
		}
		return oci.Adopt(oci.Config{ID: id, RunDir: h.RunDir, Cgroups: h.Cgroups, Runtime: h.Runtimes[wallName],
			Token: token, Log: h.Log}, pid, startTime)
	}
	cfg := process.Config{ID: id, AgentPath: h.AgentPath, RunDir: h.RunDir, Cgroups: h.Cgroups, Log: h.Log}
	return process.Adopt(cfg, pid, startTime, token)
}
