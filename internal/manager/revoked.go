package manager

import (
	"errors"

	"github.com/cagehq/cage/internal/store"
)

// What a revoked key without a team owned goes with it: its sandboxes
// (running or paused), its snapshots and its volumes are removed by the
// next sweep (every few seconds, the first soon after the daemon starts,
// so a key revoked on the host with `cage keys revoke` while the daemon
// is down is cleaned up too). Nobody can reach them any more: the key was their only
// owner, and no key is revoked back. A team's keys own nothing of their
// own (the team does), so revoking one of them removes nothing. Found by
// review, 2026-12-04: such a key's snapshots and volumes stayed on the
// host's disk for good, owned by nobody who could list or delete them,
// and its running sandboxes ran on to their end (then paused, with
// autoPause, for the paused retention).

// removeRevoked removes what the revoked keys without a team still own.
func (m *Manager) removeRevoked() {
	owners, err := m.cfg.Store.RevokedOwners()
	if err != nil || len(owners) == 0 {
		return
	}
	gone := map[string]bool{}
	for _, o := range owners {
		gone[o] = true
	}
	if recs, err := m.cfg.Store.AllSandboxes(); err == nil {
		for _, rec := range recs {
			if gone[rec.KeyID] && rec.State != store.StateCreating {
				// Not waited for (see tryTransition): a resume the key
				// still had in flight holds it, and the next sweep
				// removes what it leaves.
				unlock, ok := m.tryTransition(rec.ID)
				if !ok {
					continue
				}
				err := m.killHeld(rec.KeyID, rec.ID, "its key was revoked")
				unlock()
				if err != nil && !errors.Is(err, ErrNotFound) {
					m.log.Warn("remove a revoked key's sandbox", "sandbox", rec.ID, "key", rec.KeyID, "err", err)
				}
			}
		}
	}
	for _, o := range owners {
		for {
			snaps, _, err := m.cfg.Store.ListSnapshots(store.SnapshotFilter{KeyID: o, Limit: 100})
			if err != nil || len(snaps) == 0 {
				break
			}
			for _, sn := range snaps {
				if err := m.DeleteSnapshot(o, sn.ID); err != nil {
					m.log.Warn("remove a revoked key's snapshot", "snapshot", sn.ID, "key", o, "err", err)
					return
				}
			}
		}
		if vols, err := m.cfg.Store.ListVolumes(o); err == nil && m.cfg.Volumes != nil {
			for _, v := range vols {
				if err := m.DeleteVolume(o, v.ID); err != nil {
					// Mounted by a sandbox being made: the next sweep.
					m.log.Warn("remove a revoked key's volume", "volume", v.ID, "key", o, "err", err)
				}
			}
		}
		m.log.Info("removed what a revoked key owned", "key", o)
	}
}
