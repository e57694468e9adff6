package manager

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// Recover makes the host agree with the store after a start: every sandbox
// recorded as running whose agent is still alive is adopted and its timer
// restarted (or it is killed if its time is up); every other record is
// removed with whatever it left; sandboxes on the host that no record and no
// live process own are destroyed.
func (m *Manager) Recover() error {
	recs, err := m.cfg.Store.AllSandboxes()
	if err != nil {
		return err
	}
	m.removePartial()
	h := m.cfg.Host
	for _, rec := range recs {
		if rec.State == store.StateRunning {
			if kind := m.checkpointedMidPause(rec); kind != "" {
				// A crash as it was checkpointed: paused, as asked.
				rec.State, rec.PausedAt, rec.PauseKind, rec.AgentPID, rec.AgentStart = store.StatePaused, time.Now(), kind, 0, 0
				if kind == PauseFiles {
					rec.NetSlot = -1
				}
				_ = m.cfg.Store.UpdateSandbox(rec)
			}
		}
		if rec.State == store.StatePaused && m.recoverPaused(rec) {
			continue
		}
		if rec.State == store.StateRunning {
			sb, err := h.Adopt(rec.Wall, wall.Adoption{ID: rec.ID, PID: rec.AgentPID, StartTime: rec.AgentStart, Token: rec.AccessToken, Slot: rec.NetSlot})
			if err == nil && rec.Network != "" {
				err = m.adoptNetwork(sb, rec)
			}
			if err == nil {
				// A crash mid-pause may have left it frozen with its record
				// still saying running, and its files saved.
				_ = sb.Cgroup().Thaw()
				_ = os.Remove(m.savedFiles(rec.ID))
				if time.Now().After(rec.EndAt) {
					m.discard(sb, "timed out while the daemon was down")
					continue
				}
				m.track(sb, rec)
				m.event(rec.ID, rec.KeyID, audit.KindAdopt, nil)
				m.log.Info("sandbox adopted", "sandbox", rec.ID)
				continue
			}
			m.log.Warn("sandbox lost while the daemon was down", "sandbox", rec.ID, "err", err)
		}
		// Half-created, or gone: remove what is left and the record.
		if err := state.Remove(h.RunDir, h.Cgroups, rec.ID); err != nil {
			m.log.Warn("remove leftovers", "sandbox", rec.ID, "err", err)
		}
		_ = m.cfg.Store.DeleteSandbox(rec.ID)
		m.event(rec.ID, rec.KeyID, audit.KindRemoved, map[string]any{"reason": "state " + rec.State + " at daemon start"})
	}
	m.removeStaleCheckpoints()
	m.removeOrphanArchives()
	m.sweep()
	return nil
}

// sweep removes sandboxes on the host that no record and no live process
// own (a crash mid-create leaves such; the newest are only recognisable a
// few seconds later, so the daemon sweeps again periodically).
func (m *Manager) sweep() {
	h := m.cfg.Host
	for _, id := range state.Orphans(h.RunDir) {
		if _, err := m.cfg.Store.GetSandbox(id); err == nil {
			continue // recorded: adopted or being created
		}
		m.log.Warn("removing an orphaned sandbox", "sandbox", id)
		if err := state.Remove(h.RunDir, h.Cgroups, id); err != nil {
			m.log.Warn("remove orphan", "sandbox", id, "err", err)
		}
	}
	h.GC()
}

// Sweep runs sweep (and removes the paused sandboxes kept past their
// retention) every interval until ctx ends.
func (m *Manager) Sweep(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.sweep()
			m.expirePaused()
			m.removeRevoked()
		}
	}
}

// adoptNetwork takes over the network of an adopted sandbox: its rules now
// point at this daemon's resolver and log.
func (m *Manager) adoptNetwork(sb wall.Sandbox, rec *store.Sandbox) error {
	p, err := DecodePolicy(rec.Network)
	if err != nil {
		return fmt.Errorf("stored network policy: %w", err)
	}
	if !p.Networked() {
		return nil
	}
	if err := m.cfg.Host.AdoptNetwork(sb, rec.NetSlot, p); err != nil {
		_ = sb.Destroy()
		return err
	}
	return nil
}

// recoverPaused takes a paused sandbox back after a restart of the daemon:
// a frozen one is adopted frozen; one whose processes are gone (the host
// restarted) or that was paused with its files waits for its resume from
// them. It reports false for a record to remove (nothing to resume from).
func (m *Manager) recoverPaused(rec *store.Sandbox) bool {
	h := m.cfg.Host
	if rec.PauseKind == PauseCheckpoint && m.recoverCheckpoint(rec) {
		return true
	}
	if rec.PauseKind == PauseMemory {
		sb, err := h.Adopt(rec.Wall, wall.Adoption{ID: rec.ID, PID: rec.AgentPID, StartTime: rec.AgentStart, Token: rec.AccessToken, Slot: rec.NetSlot})
		if err == nil && rec.Network != "" {
			err = m.adoptNetwork(sb, rec)
		}
		if err == nil {
			m.track(sb, rec)
			m.event(rec.ID, rec.KeyID, audit.KindAdopt, map[string]any{"paused": true})
			m.log.Info("paused sandbox adopted", "sandbox", rec.ID)
			return true
		}
		m.log.Warn("paused sandbox lost its memory while the daemon was down; it resumes from its files", "sandbox", rec.ID, "err", err)
		if err := state.Remove(h.RunDir, h.Cgroups, rec.ID); err != nil {
			m.log.Warn("remove leftovers", "sandbox", rec.ID, "err", err)
		}
		rec.PauseKind, rec.AgentPID, rec.AgentStart, rec.NetSlot = PauseFiles, 0, 0, -1
		if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
			return false
		}
	}
	// Nothing runs for a sandbox paused with its files: whatever is on the
	// host under its id is what a crash mid-resume left.
	if err := state.Remove(h.RunDir, h.Cgroups, rec.ID); err != nil {
		m.log.Warn("remove leftovers", "sandbox", rec.ID, "err", err)
	}
	if _, err := os.Stat(m.savedFiles(rec.ID)); err != nil {
		m.log.Warn("paused sandbox has no saved files; removing it", "sandbox", rec.ID, "err", err)
		return false
	}
	return true
}

// removePartial removes the archives a crash left half-written.
func (m *Manager) removePartial() {
	for _, dir := range []string{filepath.Join(m.cfg.Data, "paused"), filepath.Join(m.cfg.Data, "snapshots")} {
		parts, _ := filepath.Glob(filepath.Join(dir, "*.part"))
		for _, p := range parts {
			_ = os.Remove(p)
		}
	}
}

// removeOrphanArchives removes the archives no record names: a crash
// between an archive's rename and its record (a snapshot's insert, a
// pause's update), or a sandbox paused mid-crash and then lost, left them
// in the data directory for good, up to a sandbox's disk and a quarter
// each, counted in no quota.
func (m *Manager) removeOrphanArchives() {
	for _, kind := range []string{"paused", "snapshots"} {
		dir := filepath.Join(m.cfg.Data, kind)
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			id, ok := strings.CutSuffix(e.Name(), ".tar")
			if !ok {
				continue
			}
			if kind == "paused" {
				if rec, err := m.cfg.Store.GetSandbox(id); err == nil && rec.State == store.StatePaused {
					continue
				} else if err != nil && !errors.Is(err, store.ErrNotFound) {
					continue // the store failed: nothing is known
				}
			} else {
				if sn, err := m.cfg.Store.GetSnapshot("", id); err == nil && sn.ID == id {
					continue
				} else if err != nil && !errors.Is(err, store.ErrNotFound) {
					continue
				}
			}
			m.log.Info("removing an archive no record names", "kind", kind, "name", e.Name())
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}
