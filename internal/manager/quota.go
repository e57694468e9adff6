package manager

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"

	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// Team quotas: what one team may hold at once (store.TeamLimits), checked
// when a sandbox is created (forks included: each fork is a create),
// resumed, or paused. What the team holds is read from the store, plus
// what its creates and resumes in progress have reserved: a reservation
// is taken under the book's lock together with the check, and a create's
// is given back in the same critical section that records the sandbox,
// so two creates at once never both take the last place. A key without a
// team has no quota (the server's own bounds hold) but a bound on what it
// keeps on the host's disk (keydisk.go).

// ErrQuota is a team over one of its quotas (429, without Retry-After:
// only a kill or a pause frees it). The error is a *QuotaError.
var ErrQuota = errors.New("quota reached")

// QuotaError names the quota a team reached: sandboxes, cpus, memory,
// disk or paused.
type QuotaError struct{ Quota, Msg string }

func (e *QuotaError) Error() string { return e.Msg }
func (e *QuotaError) Unwrap() error { return ErrQuota }

// quotaBook is the reservations of creates and resumes in progress.
type quotaBook struct {
	mu   sync.Mutex
	held map[string]store.Usage
}

// reservation is what one create or resume holds until it is recorded.
type reservation struct {
	m     *Manager
	owner string
	need  store.Usage
	done  bool
}

// release gives the reservation back (once; nil does nothing).
func (r *reservation) release() {
	if r == nil {
		return
	}
	b := &r.m.quotas
	b.mu.Lock()
	r.releaseLocked()
	b.mu.Unlock()
}

func (r *reservation) releaseLocked() {
	if r.done {
		return
	}
	r.done = true
	b := &r.m.quotas
	h := b.held[r.owner]
	h.Sandboxes -= r.need.Sandboxes
	h.CPUs -= r.need.CPUs
	h.Memory -= r.need.Memory
	h.Disk -= r.need.Disk
	h.Paused -= r.need.Paused
	if h.Sandboxes <= 0 && h.Paused <= 0 && h.CPUs < 1e-9 && h.Memory <= 0 && h.Disk <= 0 {
		delete(b.held, r.owner)
		return
	}
	b.held[r.owner] = h
}

// record runs fn (which records the sandbox in the store, so that it is
// counted there) and gives the reservation back in the same critical
// section. Without a reservation it runs fn.
func (r *reservation) record(fn func() error) error {
	if r == nil {
		return fn()
	}
	b := &r.m.quotas
	b.mu.Lock()
	defer b.mu.Unlock()
	err := fn()
	r.releaseLocked()
	return err
}

// reserve checks that owner's team can take need on top of what it holds
// and reserves it; nil (and no error) when owner has no team or the team
// no quota that need touches.
func (m *Manager) reserve(owner string, need store.Usage) (*reservation, error) {
	if need.Sandboxes < 0 || !(need.CPUs >= 0) || math.IsInf(need.CPUs, 0) || need.Memory < 0 || need.Disk < 0 || need.Paused < 0 {
		// Never reserved: it would lower the owner's usage for every
		// request beside it.
		return nil, fmt.Errorf("%w: negative or malformed limits (%+v)", ErrInvalid, need)
	}
	if !strings.HasPrefix(owner, store.TeamPrefix) {
		return nil, nil
	}
	team, err := m.cfg.Store.GetTeam(owner)
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("%w: the key's team is gone", ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	q := team.Limits
	if q.Sandboxes == 0 && q.CPUs == 0 && q.Memory == 0 && q.Disk == 0 && q.Paused == 0 {
		return nil, nil
	}
	b := &m.quotas
	b.mu.Lock()
	defer b.mu.Unlock()
	u, err := m.cfg.Store.Usage(owner, PauseMemory)
	if err != nil {
		return nil, err
	}
	h := b.held[owner]
	u.Sandboxes += h.Sandboxes
	u.CPUs += h.CPUs
	u.Memory += h.Memory
	u.Disk += h.Disk
	u.Paused += h.Paused
	if err := overQuota(team, u, need); err != nil {
		return nil, err
	}
	if b.held == nil {
		b.held = map[string]store.Usage{}
	}
	h.Sandboxes += need.Sandboxes
	h.CPUs += need.CPUs
	h.Memory += need.Memory
	h.Disk += need.Disk
	h.Paused += need.Paused
	b.held[owner] = h
	return &reservation{m: m, owner: owner, need: need}, nil
}

// reserveDisk reserves for owner's team at most max bytes of its disk
// quota, fewer when it has less left, and returns what it reserved (max,
// and no reservation, where the owner has no disk quota). A team with
// nothing left is a *QuotaError. What a snapshot's archive may take: its
// bytes are known only once it is written.
func (m *Manager) reserveDisk(owner string, max int64) (*reservation, int64, error) {
	if max < 0 {
		return nil, 0, fmt.Errorf("%w: negative disk (%d)", ErrInvalid, max)
	}
	if !strings.HasPrefix(owner, store.TeamPrefix) {
		return m.reserveKeyDisk(owner, max, true)
	}
	team, err := m.cfg.Store.GetTeam(owner)
	if errors.Is(err, store.ErrNotFound) {
		return nil, 0, fmt.Errorf("%w: the key's team is gone", ErrNotFound)
	}
	if err != nil {
		return nil, 0, err
	}
	if team.Limits.Disk == 0 {
		// No disk quota: held to the bound a key without a team has.
		return m.reserveKeyDisk(owner, max, true)
	}
	b := &m.quotas
	b.mu.Lock()
	defer b.mu.Unlock()
	u, err := m.cfg.Store.Usage(owner, PauseMemory)
	if err != nil {
		return nil, 0, err
	}
	h := b.held[owner]
	left := team.Limits.Disk - u.Disk - h.Disk
	if left <= 0 {
		return nil, 0, snapshotOverQuota(team, u.Disk+h.Disk)
	}
	got := min(max, left)
	if b.held == nil {
		b.held = map[string]store.Usage{}
	}
	h.Disk += got
	b.held[owner] = h
	return &reservation{m: m, owner: owner, need: store.Usage{Disk: got}}, got, nil
}

// snapshotOverQuota is a snapshot that does not fit its team's disk quota.
func snapshotOverQuota(t *store.Team, used int64) error {
	return &QuotaError{Quota: "disk", Msg: fmt.Sprintf("team %q's quota of %s disk is reached (%s in use, its snapshots' files included); delete one of its snapshots or kill one of its sandboxes first",
		t.Name, mib(t.Limits.Disk), mib(used))}
}

// overQuota names the first quota that need would cross.
func overQuota(t *store.Team, u, need store.Usage) error {
	q := t.Limits
	over := func(quota, what string, limit, used, asked string) error {
		return &QuotaError{Quota: quota, Msg: fmt.Sprintf("team %q's quota of %s %s is reached (%s in use, %s asked); kill or pause one of its sandboxes first",
			t.Name, limit, what, used, asked)}
	}
	const eps = 1e-9
	switch {
	case q.Sandboxes > 0 && need.Sandboxes > 0 && u.Sandboxes+need.Sandboxes > q.Sandboxes:
		return over("sandboxes", "concurrent sandboxes", fmt.Sprint(q.Sandboxes), fmt.Sprint(u.Sandboxes), fmt.Sprint(need.Sandboxes))
	case q.CPUs > 0 && need.CPUs > 0 && u.CPUs+need.CPUs > q.CPUs+eps:
		return over("cpus", "vCPUs", fmtCPUs(q.CPUs), fmtCPUs(u.CPUs), fmtCPUs(need.CPUs))
	case q.Memory > 0 && need.Memory > 0 && u.Memory+need.Memory > q.Memory:
		return over("memory", "memory", mib(q.Memory), mib(u.Memory), mib(need.Memory))
	case q.Disk > 0 && need.Disk > 0 && u.Disk+need.Disk > q.Disk:
		return over("disk", "disk", mib(q.Disk), mib(u.Disk), mib(need.Disk))
	case q.Paused > 0 && need.Paused > 0 && u.Paused+need.Paused > q.Paused:
		return &QuotaError{Quota: "paused", Msg: fmt.Sprintf("team %q's quota of %d paused sandboxes is reached (%d paused); kill or resume one of them first",
			t.Name, q.Paused, u.Paused)}
	}
	return nil
}

func fmtCPUs(v float64) string { return strings.TrimSuffix(fmt.Sprintf("%.2f", v), ".00") }

func mib(b int64) string { return fmt.Sprintf("%d MiB", b>>20) }

// createNeed is what a create will hold: its limits, the defaults where
// it names none (as sandbox.Options.Validate fills them in).
func createNeed(opts *sandbox.Options) store.Usage {
	u := store.Usage{Sandboxes: 1, CPUs: opts.CPUs, Memory: opts.Memory, Disk: opts.Disk}
	if u.CPUs == 0 {
		u.CPUs = sandbox.DefaultCPUs
	}
	if u.Memory == 0 {
		u.Memory = sandbox.DefaultMemory
	}
	if u.Disk == 0 {
		u.Disk = sandbox.DefaultDisk
	}
	// The store keeps whole MiB: count as it will.
	u.Memory, u.Disk = u.Memory>>20<<20, u.Disk>>20<<20
	return u
}

// resumeNeed is what resuming a paused sandbox adds: a running sandbox
// and its vCPUs, and its memory unless it kept it while paused.
func resumeNeed(rec *store.Sandbox) store.Usage {
	u := store.Usage{Sandboxes: 1, CPUs: rec.CPUs}
	if rec.PauseKind != PauseMemory {
		u.Memory = rec.Memory
	}
	return u
}

// Load is what the server's own bounds count now: sandboxes alive (tracked
// or being made) against max_sandboxes, and creates in flight against
// limits.creating.
func (m *Manager) Load() (live, maxLive, creating, maxCreating int) {
	m.mu.Lock()
	live = len(m.live) + m.creating
	m.mu.Unlock()
	creating, _ = m.slots.load()
	return live, m.cfg.MaxSandboxes, creating, m.cfg.MaxCreating
}
