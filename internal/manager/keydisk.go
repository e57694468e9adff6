package manager

import (
	"fmt"
	"strings"

	"github.com/cagehq/cage/internal/store"
)

// A key without a team has no quota, but what it keeps in the host's data
// directory, its paused sandboxes' files (counted at their disk sizes, a
// checkpointed sandbox's memory too, as a team's disk quota counts them)
// and its snapshots' archives, is bounded by Config.KeyDisk: a pause or a
// snapshot past it is a *QuotaError naming the disk. A team's disk quota
// bounds its own keys instead. Found by review, 2026-12-04: such a key's
// pauses and snapshots were bounded only by the host's free space, which
// one key could fill for every tenant.

// reserveKeyDisk reserves need bytes of owner's KeyDisk bound, or, with
// upTo, at most need (what is left where less): what a snapshot's archive
// may take. It returns what it reserved: need, and no reservation, where
// owner has a team or there is no bound.
func (m *Manager) reserveKeyDisk(owner string, need int64, upTo bool) (*reservation, int64, error) {
	if m.cfg.KeyDisk <= 0 || strings.HasPrefix(owner, store.TeamPrefix) || need <= 0 {
		return nil, need, nil
	}
	b := &m.quotas
	b.mu.Lock()
	defer b.mu.Unlock()
	kept, err := m.cfg.Store.KeptOnDisk(owner)
	if err != nil {
		return nil, 0, err
	}
	h := b.held[owner]
	left := m.cfg.KeyDisk - kept - h.Disk
	got := need
	if upTo {
		got = min(need, left)
	}
	if left <= 0 || got > left {
		return nil, 0, &QuotaError{Quota: "disk", Msg: fmt.Sprintf("this key's bound of %s on the host's disk is reached (%s kept by its paused sandboxes and snapshots, %s asked); delete one of its snapshots or kill one of its paused sandboxes first",
			mib(m.cfg.KeyDisk), mib(kept+h.Disk), mib(need))}
	}
	if b.held == nil {
		b.held = map[string]store.Usage{}
	}
	h.Disk += got
	b.held[owner] = h
	return &reservation{m: m, owner: owner, need: store.Usage{Disk: got}}, got, nil
}
