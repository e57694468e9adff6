package manager

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cagehq/cage/internal/store"
)

// A key without a team has no quota, but what it keeps in the host's data
// directory, its paused sandboxes' files (counted at their disk sizes, a
// checkpointed sandbox's memory too, as a team's disk quota counts them)
// and its snapshots' archives, is bounded by Config.KeyDisk: a pause or a
// snapshot past it is a *QuotaError naming the disk. A team's disk quota
// bounds its own keys instead; a team without a disk quota (none at all,
// or only others) is held to KeyDisk as a whole, as one owner. Found by
// review, 2026-12-04: such a key's pauses and snapshots were bounded only
// by the host's free space, which one key could fill for every tenant;
// and, the same day, a team given no disk quota still could.

// reserveKeyDisk reserves need bytes of owner's KeyDisk bound, or, with
// upTo, at most need (what is left where less): what a snapshot's archive
// may take. It returns what it reserved: need, and no reservation, where
// owner is a team with a disk quota or there is no bound.
func (m *Manager) reserveKeyDisk(owner string, need int64, upTo bool) (*reservation, int64, error) {
	if m.cfg.KeyDisk <= 0 || need <= 0 {
		return nil, need, nil
	}
	whose := "this key's"
	if strings.HasPrefix(owner, store.TeamPrefix) {
		team, err := m.cfg.Store.GetTeam(owner)
		if errors.Is(err, store.ErrNotFound) {
			return nil, 0, fmt.Errorf("%w: the key's team is gone", ErrNotFound)
		}
		if err != nil {
			return nil, 0, err
		}
		if team.Limits.Disk > 0 {
			return nil, need, nil // its quota bounds it (reserve, reserveDisk)
		}
		whose = fmt.Sprintf("team %q's (it has no disk quota)", team.Name)
	}
	// Its own line in the book: a team's creates in progress reserve
	// their sandboxes' disks under the owner's, which this bound does not
	// count.
	book := keyDiskBook + owner
	b := &m.quotas
	b.mu.Lock()
	defer b.mu.Unlock()
	kept, err := m.cfg.Store.KeptOnDisk(owner)
	if err != nil {
		return nil, 0, err
	}
	h := b.held[book]
	left := m.cfg.KeyDisk - kept - h.Disk
	got := need
	if upTo {
		got = min(need, left)
	}
	if left <= 0 || got > left {
		return nil, 0, &QuotaError{Quota: "disk", Msg: fmt.Sprintf("%s bound of %s on the host's disk is reached (%s kept by its paused sandboxes and snapshots, %s asked); delete one of its snapshots or kill one of its paused sandboxes first",
			whose, mib(m.cfg.KeyDisk), mib(kept+h.Disk), mib(need))}
	}
	if b.held == nil {
		b.held = map[string]store.Usage{}
	}
	h.Disk += got
	b.held[book] = h
	return &reservation{m: m, owner: book, need: store.Usage{Disk: got}}, got, nil
}

// keyDiskBook prefixes an owner's reservations of its KeyDisk bound in the
// quota book.
const keyDiskBook = "keydisk:"
