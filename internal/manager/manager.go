// Package manager is the daemon's sandbox manager: it creates sandboxes and
// records them in the store before they run anything, kills them at their
// end time, extends them, and after a restart of the daemon re-adopts the
// ones still running and removes whatever a crash left half-made. The store
// is the truth about which sandboxes exist; the host is made to agree with it.
package manager

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/metrics"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/proxy"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/volume"
	"github.com/cagehq/cage/internal/wall"
)

// Error kinds, mapped to HTTP statuses by the API.
var (
	ErrNotFound = errors.New("not found")
	ErrInvalid  = sandbox.ErrInvalid
	ErrLimit    = errors.New("limit reached")
	ErrConflict = errors.New("conflict")
)

// Config configures a Manager.
type Config struct {
	Store           *store.Store
	Host            *sandbox.Host
	Log             *slog.Logger
	DefaultTimeout  time.Duration // E2B's: 300 s
	MaxTimeout      time.Duration // a create or extension beyond it is refused
	DefaultTemplate string
	MaxSandboxes    int // alive at once; 0 = no limit
	// MaxCreating bounds the creates in progress (0: 4 per CPU); up to
	// waitFactor times as many wait for a slot, and the rest get ErrLimit
	// at once.
	MaxCreating int
	// Max is the ceiling on one sandbox's limits (zero fields: the host's).
	Max sandbox.Maxima
	// Data is the daemon's data directory: paused sandboxes' files and
	// snapshots are kept under it.
	Data string
	// PausedRetention is how long a paused sandbox is kept (0: 30 days).
	PausedRetention time.Duration
	// Volumes keeps the volumes' files (nil: the server has no volumes).
	Volumes *volume.Manager
	// MaxVolumes is how many volumes one key may have (0: DefaultMaxVolumes).
	MaxVolumes int
	// KeyDisk bounds what a key without a team, or a team without a
	// disk quota, keeps in the data directory: its paused sandboxes and
	// snapshots (0: no bound; see keydisk.go).
	KeyDisk int64
	// Audit is the audit trail (nil: none).
	Audit *audit.Trail
	// Metrics counts creates, resumes, ends, limit hits and network
	// decisions (nil: none).
	Metrics *metrics.Metrics
	// Changed, when set, is told of every change to a sandbox that others
	// may see, with its audit kind: created, ended (kill, timeout, died,
	// removed), paused, resumed, adopted, and ChangeEnd when its end moved.
	// It must not block (cluster mode queues the id and reads the record).
	Changed func(id, kind string)
}

// ChangeEnd is Config.Changed's kind for a sandbox whose end moved.
const ChangeEnd = "sandbox.end"

// Manager owns the daemon's sandboxes.
type Manager struct {
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	live     map[string]*entry
	creating int
	closed   bool

	rec atomic.Pointer[recorder] // network records (records.go)

	slots *createSlots // creates in progress and waiting (createslots.go)

	transMu     sync.Mutex
	transitions map[string]*transitionLock // by sandbox id (see transition)

	// volMu guards volLocks: each owner's lock of a create or resume
	// that mounts its volumes (read, until its sandbox has started: a
	// restore after that holds it not) against its volumes' creation or
	// deletion (write) (volumes.go, volumeLock).
	volMu    sync.Mutex
	volLocks map[string]*volumeLock
	// metrics: each sandbox's samples (metrics.go).
	metrics metricsTable
	// quotas: the teams' reservations in progress (quota.go).
	quotas quotaBook
}

type entry struct {
	sb      wall.Sandbox
	timer   *time.Timer
	traffic string // the traffic token, wanted at exposed ports unless public
	public  bool

	mu     sync.Mutex
	paused bool // frozen (see Pause)
}

func (e *entry) setPaused(v bool) {
	e.mu.Lock()
	e.paused = v
	e.mu.Unlock()
}

func (e *entry) isPaused() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.paused
}

// New returns a manager; call Recover before serving.
func New(cfg Config) *Manager {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.DefaultTimeout == 0 {
		cfg.DefaultTimeout = 300 * time.Second
	}
	if cfg.MaxTimeout == 0 {
		cfg.MaxTimeout = 24 * time.Hour
	}
	if cfg.DefaultTemplate == "" {
		cfg.DefaultTemplate = "host"
	}
	if cfg.MaxCreating <= 0 {
		cfg.MaxCreating = 4 * runtime.NumCPU()
	}
	if cfg.PausedRetention <= 0 {
		cfg.PausedRetention = DefaultPausedRetention
	}
	return &Manager{cfg: cfg, log: cfg.Log, live: map[string]*entry{}, transitions: map[string]*transitionLock{}, volLocks: map[string]*volumeLock{}, slots: newCreateSlots(cfg.MaxCreating)}
}

// CreateRequest is what a client asks for.
type CreateRequest struct {
	// ID is the sandbox's id when the caller chose it (cluster mode: the
	// pod's name); "" mints one. It must have ids.NewID's format and name
	// no sandbox this host has. A given id takes no prepared sandbox from
	// the pool (a prepared one has its own id).
	ID            string
	Wall          string // a wall of the registry (sandbox.Walls); "" is the default
	KeyID         string
	Template      string
	Timeout       time.Duration // 0: the default
	Metadata, Env map[string]string
	CPUs          float64
	Memory        int64 // bytes; 0: the default
	Disk          int64 // bytes; 0: the default
	Pids          int64
	Net           network.Policy // what the sandbox may reach
	PublicTraffic bool           // exposed ports answer without the traffic token
	HTTPSPorts    []int          // ports the proxy reaches over TLS (E2B's network.httpsPorts)
	// Lifecycle: pause at the timeout instead of ending (keeping memory or
	// only files), and resume on traffic through the proxy.
	AutoPause, AutoPauseMemory, AutoResume bool
	// Volumes are the key's volumes to mount, by name (see volumes.go).
	Volumes []VolumeMount

	mounts []store.VolumeMount // Volumes resolved (Create)
	quota  *reservation        // the team's quota, reserved (Create)
	// started lets go of what only the start needs, once the sandbox
	// runs: the host's create slot and the volume lock (the record names
	// the volumes by then). What comes after, a snapshot's restore, is
	// the sandbox's own work at its own pace (Create).
	started func()
}

// wallLabel is the wall a create asked for, as a metric's label: the
// registry's name for it, "invalid" for a name it does not know.
func (m *Manager) wallLabel(name string) string {
	if m.cfg.Host == nil {
		return name
	}
	d, err := m.cfg.Host.Driver(name)
	if err != nil || d == nil {
		return "invalid"
	}
	return d.Name()
}

// checkID refuses a given sandbox id that is malformed or taken.
func (m *Manager) checkID(id string) error {
	if id == "" {
		return nil
	}
	if !ids.Valid(id) {
		return fmt.Errorf("%w: sandbox id %q is not 20 lowercase hex characters", ErrInvalid, id)
	}
	if _, err := m.cfg.Store.GetSandbox(id); err == nil {
		return fmt.Errorf("%w: sandbox %s exists", ErrConflict, id)
	} else if !errors.Is(err, store.ErrNotFound) {
		return err
	}
	return nil
}

// Bounds of a sandbox's metadata and of its environment, each: they are
// kept in its record, listed and sent back whole.
const (
	maxStringsEntries = 256
	maxStringsKey     = 256
	maxStringsValue   = 16 << 10
	maxStringsBytes   = 64 << 10
)

// checkStrings refuses a metadata or environment map beyond its bounds.
func checkStrings(field string, m map[string]string) error {
	if len(m) > maxStringsEntries {
		return fmt.Errorf("%w: %s: %d entries, at most %d", ErrInvalid, field, len(m), maxStringsEntries)
	}
	total := 0
	for k, v := range m {
		if len(k) > maxStringsKey {
			return fmt.Errorf("%w: %s: a name of %d bytes, at most %d", ErrInvalid, field, len(k), maxStringsKey)
		}
		if len(v) > maxStringsValue {
			return fmt.Errorf("%w: %s: the value of %.64q is %d bytes, at most %d", ErrInvalid, field, k, len(v), maxStringsValue)
		}
		total += len(k) + len(v)
	}
	if total > maxStringsBytes {
		return fmt.Errorf("%w: %s: %d bytes in all, at most %d", ErrInvalid, field, total, maxStringsBytes)
	}
	return nil
}

func (m *Manager) checkTimeout(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%w: timeout must be at least 1 second", ErrInvalid)
	}
	if d > m.cfg.MaxTimeout {
		return fmt.Errorf("%w: timeout is above this server's maximum of %v", ErrInvalid, m.cfg.MaxTimeout)
	}
	return nil
}

// Create makes a sandbox and starts its timer. The record is written before
// the sandbox starts, so a crash at any point leaves either a record that
// Recover cleans up, or a prepared agent that exits when its creator dies.
func (m *Manager) Create(ctx context.Context, req CreateRequest) (rec *store.Sandbox, err error) {
	start := time.Now()
	defer func() {
		if !errors.Is(err, ErrQuota) && !errors.Is(err, ErrInvalid) {
			m.cfg.Metrics.Created(m.wallLabel(req.Wall), time.Since(start), err)
		}
	}()
	if req.Timeout == 0 {
		req.Timeout = m.cfg.DefaultTimeout
	}
	if err := m.checkTimeout(req.Timeout); err != nil {
		return nil, err
	}
	if req.Template == "" {
		req.Template = m.cfg.DefaultTemplate
	}
	if err := m.checkID(req.ID); err != nil {
		return nil, err
	}
	if err := checkStrings("metadata", req.Metadata); err != nil {
		return nil, err
	}
	if err := checkStrings("envVars", req.Env); err != nil {
		return nil, err
	}
	snap, err := m.fromSnapshot(&req)
	if err != nil {
		return nil, err
	}
	opts := sandbox.Options{ID: req.ID,
		Wall: req.Wall, Template: req.Template, Env: req.Env, CPUs: req.CPUs,
		Memory: req.Memory, Disk: req.Disk, Pids: req.Pids, Net: req.Net, Max: m.cfg.Max,
	}
	m.cfg.Host.TemplateDefaults(&opts) // what the template asks for where the create names nothing (desktop: memory)
	// The limits are checked before they count against the team's quota:
	// a negative or malformed one reserved would lower the team's usage
	// for every create beside it until this one failed.
	checked := opts // Validate fills in defaults; opts keeps what was asked
	if err := checked.Validate(); err != nil {
		return nil, err
	}
	// The team's quota is reserved before the server's bounds are taken
	// (max_sandboxes, a create slot, a waiting place): a create its quota
	// refuses holds none of them, even for a moment.
	if req.quota, err = m.reserve(req.KeyID, createNeed(&opts)); err != nil {
		return nil, err
	}
	defer req.quota.release()
	if err := m.admit(); err != nil {
		return nil, err
	}
	defer m.admitted()
	release, err := m.createSlot(ctx, req.KeyID)
	if err != nil {
		return nil, err
	}
	release = sync.OnceFunc(release)
	defer release()
	unlockVolumes := func() {}
	if len(req.Volumes) > 0 {
		// Until the record names them, no volume of the owner's is
		// deleted (only its owner's calls name a volume).
		unlockVolumes = sync.OnceFunc(m.lockVolumes(req.KeyID, false))
		defer unlockVolumes()
		if req.mounts, opts.Volumes, err = m.openMounts(req.KeyID, req.Volumes); err != nil {
			return nil, err
		}
		defer closeVolumes(opts.Volumes)
	}
	req.started = func() { release(); unlockVolumes() }
	var sb wall.Sandbox
	for attempt := 0; ; attempt++ {
		var err error
		sb, rec, err = m.start(ctx, req, &opts, snap)
		if errors.Is(err, wall.ErrStale) && attempt < 8 {
			continue // a pooled sandbox older than its template's files; the next is fresher
		}
		if err != nil {
			return nil, err
		}
		break
	}
	m.track(sb, rec)
	m.event(rec.ID, rec.KeyID, audit.KindCreate, map[string]any{"template": rec.TemplateID, "wall": rec.Wall,
		"cpus": rec.CPUs, "memory": rec.Memory, "disk": rec.Disk, "pids": rec.Pids, "timeout_s": rec.TimeoutSeconds,
		"network": rec.Network, "public_traffic": rec.PublicTraffic, "agent_pid": rec.AgentPID})
	m.log.Info("sandbox created", "sandbox", rec.ID, "template", rec.TemplateID)
	return rec, nil
}

// start names a sandbox, records it (state creating, so that a crash
// leaves a record the next start cleans up), then starts it.
func (m *Manager) start(ctx context.Context, req CreateRequest, opts *sandbox.Options, snap *store.Snapshot) (wall.Sandbox, *store.Sandbox, error) {
	p, err := m.cfg.Host.Begin(ctx, opts)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	rec := &store.Sandbox{
		ID: p.ID(), KeyID: req.KeyID, TemplateID: req.Template, Wall: opts.Wall,
		State: store.StateCreating, Metadata: req.Metadata, EnvVars: req.Env,
		CPUs: opts.CPUs, Memory: opts.Memory, Disk: opts.Disk, Pids: opts.Pids,
		AccessToken: p.Spec().Token, TrafficToken: ids.NewToken(),
		StartedAt: now, EndAt: now.Add(req.Timeout), AllowInternet: req.Net.Mode == network.Internet, AutoPause: req.AutoPause,
		NetSlot: -1, PublicTraffic: req.PublicTraffic, AutoPauseMemory: req.AutoPauseMemory, AutoResume: req.AutoResume,
		TimeoutSeconds: int64(req.Timeout / time.Second), VolumeMounts: req.mounts, HTTPSPorts: req.HTTPSPorts,
	}
	if err := req.quota.record(func() error { return m.cfg.Store.InsertSandbox(rec) }); err != nil {
		p.Abort()
		return nil, nil, err
	}
	sb, err := p.Start(ctx)
	if err == nil && req.started != nil {
		// A snapshot's restore takes as long as its files make it (a
		// tree thousands of directories deep took the agent minutes):
		// it must not hold the host's create slots, which every tenant's
		// creates wait for, or the volume lock, which every volume's
		// create and delete wait for.
		req.started()
	}
	if err == nil && snap != nil {
		c := agentclient.New(sb.Dial, sb.Token())
		if err = m.restoreSnapshot(ctx, snap, c); err != nil {
			_ = sb.Destroy()
		}
		c.Close()
	}
	if err != nil {
		_ = m.cfg.Store.DeleteSandbox(rec.ID)
		return nil, nil, err
	}
	rec.State, rec.AgentPID = store.StateRunning, sb.AgentPID()
	rec.AgentStart, _ = hostproc.StartTime(sb.AgentPID())
	setNetwork(rec, sb)
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		m.discard(sb, "record failed: "+err.Error())
		return nil, nil, err
	}
	return sb, rec, nil
}

// setNetwork records a started sandbox's network (its policy and slot).
func setNetwork(rec *store.Sandbox, sb wall.Sandbox) {
	rec.Network, rec.NetSlot = "", -1
	if n := sb.Network(); n != nil {
		rec.Network, rec.NetSlot = EncodePolicy(n.Policy()), n.Slot
	}
}

// EncodePolicy is a policy as the store keeps it.
func EncodePolicy(p network.Policy) string {
	b, _ := json.Marshal(p)
	return string(b)
}

// DecodePolicy reads a stored policy ("" is none).
func DecodePolicy(s string) (network.Policy, error) {
	var p network.Policy
	if s == "" {
		return network.Policy{Mode: network.None}, nil
	}
	err := json.Unmarshal([]byte(s), &p)
	return p, err
}

// SetNetwork replaces the network policy of a running sandbox.
//
// It holds the sandbox's transition lock and reads the record under it: a
// pause or resume between its read and its write would otherwise be
// undone by the record it writes back (a sandbox recorded paused while it
// ran, out of its team's quota; one destroyed by a pause recorded running).
func (m *Manager) SetNetwork(keyID, id string, p network.Policy) (*store.Sandbox, error) {
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	e := m.live[id]
	m.mu.Unlock()
	if e == nil {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	n := e.sb.Network()
	if n == nil {
		return nil, fmt.Errorf("%w: sandbox %q was created without a network (loopback only); its policy cannot change", ErrConflict, id)
	}
	if err := n.SetPolicy(p); err != nil {
		if errors.Is(err, network.ErrPolicy) {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		return nil, err
	}
	setNetwork(rec, e.sb)
	rec.AllowInternet = n.Policy().Mode == network.Internet
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		return nil, err
	}
	m.event(id, rec.KeyID, audit.KindNetwork, map[string]any{"network": rec.Network})
	return rec, nil
}

func (m *Manager) admit() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("%w: the server is stopping", ErrLimit)
	}
	if m.cfg.MaxSandboxes > 0 && len(m.live)+m.creating >= m.cfg.MaxSandboxes {
		return fmt.Errorf("%w: %d sandboxes are running, this server's maximum", ErrLimit, m.cfg.MaxSandboxes)
	}
	m.creating++
	return nil
}

func (m *Manager) admitted() {
	m.mu.Lock()
	m.creating--
	m.mu.Unlock()
}

// track starts the sandbox's end timer and watches for its death.
func (m *Manager) track(sb wall.Sandbox, rec *store.Sandbox) {
	e := &entry{sb: sb, traffic: rec.TrafficToken, public: rec.PublicTraffic, paused: rec.State == store.StatePaused}
	m.startSampler()
	m.mu.Lock()
	m.live[sb.ID()] = e
	e.timer = time.AfterFunc(time.Until(rec.EndAt), func() { m.timedOut(sb.ID()) })
	if e.paused {
		e.timer.Stop() // a paused sandbox does not time out
	}
	m.mu.Unlock()
	go func() {
		<-sb.Exited()
		m.mu.Lock()
		cur := m.live[sb.ID()]
		m.mu.Unlock()
		if cur == e {
			m.log.Warn("sandbox died", "sandbox", sb.ID(), "err", sb.Err())
			m.remove(sb.ID(), "died: "+sb.Err().Error())
		}
	}()
}

func (m *Manager) expire(id string) {
	m.log.Info("sandbox timed out", "sandbox", id)
	m.remove(id, "timed out")
}

// remove destroys a tracked sandbox and forgets it.
func (m *Manager) remove(id, why string) {
	m.mu.Lock()
	e := m.live[id]
	delete(m.live, id)
	m.mu.Unlock()
	if e == nil {
		return
	}
	e.timer.Stop()
	m.metrics.forget(id)
	_ = os.Remove(m.savedFiles(id))       // a frozen sandbox's backup
	_ = os.RemoveAll(m.checkpointDir(id)) // a checkpointed one's
	m.discard(e.sb, why)
}

// discard destroys a sandbox and deletes its record.
func (m *Manager) discard(sb wall.Sandbox, why string) {
	if err := sb.Destroy(); err != nil {
		m.log.Warn("destroy", "sandbox", sb.ID(), "err", err)
	}
	key := m.Owner(sb.ID())
	if err := m.cfg.Store.DeleteSandbox(sb.ID()); err != nil && !errors.Is(err, store.ErrNotFound) {
		m.log.Warn("delete record", "sandbox", sb.ID(), "err", err)
	}
	m.event(sb.ID(), key, endKind(why), map[string]any{"reason": why})
}

// Get returns a sandbox that keyID may see ("" sees all).
func (m *Manager) Get(keyID, id string) (*store.Sandbox, error) {
	if !ids.Valid(id) { // no sandbox has such an id: not looked up
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id[:min(len(id), 64)])
	}
	rec, err := m.cfg.Store.GetSandbox(id)
	if errors.Is(err, store.ErrNotFound) || (err == nil && keyID != "" && rec.KeyID != keyID) {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	if err == nil && rec.State == store.StateCreating {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	return rec, err
}

// List returns a page of keyID's sandboxes.
func (m *Manager) List(f store.ListFilter) ([]*store.Sandbox, string, error) {
	if len(f.States) == 0 {
		f.States = []string{store.StateRunning, store.StatePaused}
	}
	items, next, err := m.cfg.Store.ListSandboxes(f)
	if errors.Is(err, store.ErrInvalidCursor) {
		return nil, "", fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return items, next, err
}

// Kill destroys a sandbox now, paused or not.
func (m *Manager) Kill(keyID, id string) error {
	return m.kill(keyID, id, "killed by request")
}

// kill is Kill, for the reason why.
func (m *Manager) kill(keyID, id, why string) error {
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return err
	}
	defer unlock()
	return m.killHeld(keyID, id, why)
}

// killHeld is kill with the sandbox's transition lock held.
func (m *Manager) killHeld(keyID, id, why string) error {
	rec, err := m.Get(keyID, id)
	if err != nil {
		return err
	}
	if rec.State == store.StatePaused && rec.PauseKind == PauseFiles {
		return m.killPaused(rec, why)
	}
	m.mu.Lock()
	_, ok := m.live[id]
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	m.remove(id, why)
	return nil
}

// SetTimeout makes the sandbox end d from now.
func (m *Manager) SetTimeout(keyID, id string, d time.Duration) (*store.Sandbox, error) {
	if err := m.checkTimeout(d); err != nil {
		return nil, err
	}
	// Under the transition lock: a timer re-armed in the midst of a
	// pause would end the sandbox it paused.
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return m.setTimeout(keyID, id, d)
}

// setTimeout is SetTimeout with the sandbox's transition lock held.
func (m *Manager) setTimeout(keyID, id string, d time.Duration) (*store.Sandbox, error) {
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	e := m.live[id]
	if e == nil && rec.State != store.StatePaused {
		m.mu.Unlock()
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	rec.EndAt = time.Now().Add(d)
	if e != nil && !e.isPaused() { // a paused sandbox's timer starts at its resume
		e.timer.Reset(d)
	}
	m.mu.Unlock()
	if err := m.cfg.Store.SetEndAt(id, rec.EndAt); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
		}
		return nil, err
	}
	m.changed(id, ChangeEnd)
	return rec, nil
}

// tracked returns the sandbox tracked under id (paused with its memory or
// running).
func (m *Manager) tracked(id string) (wall.Sandbox, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.live[id]
	if e == nil {
		return nil, false
	}
	return e.sb, true
}

// Lookup tells the traffic proxy how to authorize traffic to a sandbox:
// its access and traffic tokens and whether its ports are public. A paused
// sandbox is found only where traffic resumes it.
//
// It reads only those columns: anyone may send requests naming a sandbox,
// and decoding the whole record (its metadata and environment) on each
// made them cheap to send and dear to answer.
func (m *Manager) Lookup(id string) (proxy.Access, bool) {
	rec, err := m.cfg.Store.GetSandboxAccess(id)
	if err != nil || rec.State == store.StateCreating {
		return proxy.Access{}, false
	}
	if rec.State == store.StatePaused && !rec.AutoResume {
		return proxy.Access{}, false
	}
	return proxy.Access{Token: rec.AccessToken, Traffic: rec.TrafficToken, Public: rec.PublicTraffic, Owner: rec.KeyID,
		HTTPSPorts: rec.HTTPSPorts}, true
}

// Ready returns the running sandbox for the traffic proxy, which has
// authorized the request: a paused sandbox that resumes on traffic is
// resumed first, for the timeout it was created with.
func (m *Manager) Ready(ctx context.Context, id string, mayResume bool) (wall.Sandbox, error) {
	m.mu.Lock()
	e := m.live[id]
	m.mu.Unlock()
	if e != nil && !e.isPaused() {
		return e.sb, nil
	}
	rec, err := m.cfg.Store.GetSandbox(id)
	if err != nil || rec.State != store.StatePaused || !rec.AutoResume || !mayResume {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	d := time.Duration(rec.TimeoutSeconds) * time.Second
	if d <= 0 {
		d = m.cfg.DefaultTimeout
	}
	if _, _, err := m.Resume(ctx, "", id, min(d, m.cfg.MaxTimeout), true); err != nil {
		return nil, err
	}
	m.mu.Lock()
	e = m.live[id]
	m.mu.Unlock()
	if e == nil {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	m.log.Info("sandbox resumed by traffic", "sandbox", id)
	return e.sb, nil
}

// Records returns the stored record of a running sandbox.
func (m *Manager) Record(id string) (*store.Sandbox, error) {
	return m.Get("", id)
}

// Close stops the timers; the sandboxes keep running for the next daemon
// to adopt.
func (m *Manager) Close() {
	m.stopSampler()
	m.FlushRecords()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	for _, e := range m.live {
		e.timer.Stop()
	}
}

// Count is the number of running sandboxes.
func (m *Manager) Count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.live)
}
