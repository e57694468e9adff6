package manager

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// PauseCheckpoint is a pause with memory on a wall that checkpoints
// (wall.Checkpointer: gVisor, microvm): its files saved as for every
// pause, then the wall saves the whole sandbox (memory, processes) into
// DATA/checkpoints/ID and stops it, every byte of its RAM released (on
// gVisor its disk, a tmpfs on the host, stays). Resume restores it from
// there, processes going on where they stood. A checkpoint that cannot be
// used (it was lost with the host's run directory, its slot was taken,
// the restore fails) is given up: the sandbox resumes from its files.
//
// The checkpoint is what runsc or QEMU wrote from the sandbox's memory:
// the daemon stores it, removes it, and hands it to the same wall's
// runtime for this one sandbox's restore; it never reads it, and no
// request can name one.
//
// Its checkpoint, up to its memory, counts in its team's disk quota while
// it is paused so (store.PauseCheckpoint).
const PauseCheckpoint = store.PauseCheckpoint

// checkpointOps bounds a checkpoint or a restore, whatever the request's
// context does: one cut short halfway leaves a sandbox stopped.
const checkpointOps = 5 * time.Minute

func (m *Manager) checkpointDir(id string) string {
	return filepath.Join(m.cfg.Data, "checkpoints", id)
}

// checkpointable is sb's ability to checkpoint when its wall has it here,
// else nil (the wall freezes).
func (m *Manager) checkpointable(wallName string, sb wall.Sandbox) wall.Checkpointable {
	d, err := m.cfg.Host.Driver(wallName)
	if err != nil {
		return nil
	}
	if c, ok := d.(wall.Checkpointer); !ok || c.CheckpointsMissing() != nil {
		return nil
	}
	cp, _ := sb.(wall.Checkpointable)
	return cp
}

// pauseCheckpoint checkpoints a running sandbox whose files are saved.
// On error it runs on as before.
func (m *Manager) pauseCheckpoint(ctx context.Context, rec *store.Sandbox, e *entry, cp wall.Checkpointable) error {
	dir := m.checkpointDir(rec.ID)
	part := dir + ".part"
	_ = os.RemoveAll(part)
	_ = os.RemoveAll(dir)
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return err
	}
	// Its memory, at most, and a VM's own.
	if need := rec.Memory + 256<<20; rec.Memory > 0 {
		var fs unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(dir), &fs); err == nil {
			if free := int64(fs.Bavail) * fs.Bsize; free < need {
				return fmt.Errorf("%w: not enough disk space to checkpoint it (%d MiB free under %s, up to %d MiB needed)",
					sandbox.ErrUnavailable, free>>20, filepath.Dir(dir), need>>20)
			}
		}
	}
	if err := os.Mkdir(part, 0o700); err != nil {
		return err
	}
	e.timer.Stop()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), checkpointOps)
	defer cancel()
	err := cp.Checkpoint(ctx, part)
	if err == nil {
		err = os.Rename(part, dir)
	}
	if err != nil {
		_ = os.RemoveAll(part)
		if errors.Is(err, wall.ErrStopped) {
			return m.stoppedMidCheckpoint(rec, e, err)
		}
		e.timer.Reset(time.Until(rec.EndAt))
		if errors.Is(err, unix.ENOSPC) || diskFull(filepath.Dir(dir)) {
			return fmt.Errorf("%w: the disk filled while checkpointing it: %v", sandbox.ErrUnavailable, err)
		}
		return err
	}
	e.setPaused(true)
	rec.State, rec.PausedAt, rec.PauseKind = store.StatePaused, time.Now(), PauseCheckpoint
	rec.AgentPID, rec.AgentStart = 0, 0
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		// Not recorded: run it again.
		if rerr := cp.Restore(ctx, dir, nil); rerr != nil {
			m.log.Warn("restore after a checkpoint not recorded", "sandbox", rec.ID, "err", rerr)
		}
		_ = os.RemoveAll(dir)
		e.setPaused(false)
		e.timer.Reset(time.Until(rec.EndAt))
		return err
	}
	m.event(rec.ID, rec.KeyID, audit.KindPause, map[string]any{"kind": PauseCheckpoint})
	m.log.Info("sandbox paused", "sandbox", rec.ID, "kind", PauseCheckpoint)
	return nil
}

// stoppedMidCheckpoint pauses with its files a sandbox whose failed
// checkpoint stopped it (its files were saved first): nothing is lost but
// its processes, and the pause succeeds as one without memory.
func (m *Manager) stoppedMidCheckpoint(rec *store.Sandbox, e *entry, cause error) error {
	m.log.Warn("checkpoint failed and stopped the sandbox; it is paused with its files", "sandbox", rec.ID, "err", cause)
	_ = m.cfg.Store.AddEvent(rec.ID, "checkpoint failed", cause.Error())
	rec.State, rec.PausedAt, rec.PauseKind = store.StatePaused, time.Now(), PauseFiles
	rec.AgentPID, rec.AgentStart, rec.NetSlot = 0, 0, -1
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		return err
	}
	m.forget(rec.ID, e)
	if err := e.sb.Destroy(); err != nil {
		m.log.Warn("destroy after a failed checkpoint", "sandbox", rec.ID, "err", err)
	}
	_ = m.cfg.Store.AddEvent(rec.ID, "paused", PauseFiles)
	return nil
}

// diskFull reports whether the file system of dir has no room left.
func diskFull(dir string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(dir, &fs) == nil && fs.Bavail == 0
}

// resumeCheckpoint restores a checkpointed sandbox, or, without memory or
// when its checkpoint cannot be used, gives the checkpoint up and starts
// it again from its files.
func (m *Manager) resumeCheckpoint(ctx context.Context, rec *store.Sandbox, d time.Duration, keepMemory bool) error {
	m.mu.Lock()
	e := m.live[rec.ID]
	m.mu.Unlock()
	var cp wall.Checkpointable
	if e != nil {
		cp, _ = e.sb.(wall.Checkpointable)
	}
	if keepMemory && cp != nil {
		// A restore starts the sandbox again: a create's slot, let go
		// once the runtime runs it (its agent's coming back is the
		// sandbox's own doing, as long as a compromised agent or guest
		// makes it, up to checkpointOps) or before a resume from the
		// saved files takes its own.
		release, err := m.createSlot(ctx, rec.KeyID)
		if err != nil {
			return err
		}
		release = sync.OnceFunc(release)
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), checkpointOps)
		err = cp.Restore(rctx, m.checkpointDir(rec.ID), release)
		cancel()
		release()
		if err == nil {
			return m.restored(rec, e, d)
		}
		m.log.Warn("checkpoint unusable; resuming from the saved files", "sandbox", rec.ID, "err", err)
		m.event(rec.ID, rec.KeyID, audit.KindCheckpoint, map[string]any{"usable": false, "error": err.Error()})
	}
	if e != nil {
		m.forget(rec.ID, e)
		if err := e.sb.Destroy(); err != nil {
			m.log.Warn("destroy a checkpointed sandbox", "sandbox", rec.ID, "err", err)
		}
	}
	_ = os.RemoveAll(m.checkpointDir(rec.ID))
	rec.PauseKind, rec.AgentPID, rec.AgentStart, rec.NetSlot = PauseFiles, 0, 0, -1
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		return err
	}
	return m.resumeFiles(ctx, rec, d)
}

// restored records a sandbox restored from its checkpoint as running.
func (m *Manager) restored(rec *store.Sandbox, e *entry, d time.Duration) error {
	rec.State, rec.PausedAt, rec.PauseKind, rec.EndAt = store.StateRunning, time.Time{}, "", time.Now().Add(d)
	rec.AgentPID = e.sb.AgentPID()
	rec.AgentStart, _ = hostproc.StartTime(rec.AgentPID)
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		return err
	}
	e.setPaused(false)
	e.timer.Reset(d)
	_ = os.RemoveAll(m.checkpointDir(rec.ID))
	_ = os.Remove(m.savedFiles(rec.ID))
	m.event(rec.ID, rec.KeyID, audit.KindResume, map[string]any{"kind": PauseCheckpoint})
	m.log.Info("sandbox resumed", "sandbox", rec.ID, "kind", PauseCheckpoint)
	return nil
}

// recoverCheckpoint takes a checkpointed sandbox back after a restart of
// the daemon. It reports false when the checkpoint cannot be used (the
// host restarted, its slot is taken): the record is then a sandbox paused
// with its files, its checkpoint removed.
func (m *Manager) recoverCheckpoint(rec *store.Sandbox) bool {
	dir := m.checkpointDir(rec.ID)
	sb, err := m.adoptCheckpointed(rec, dir)
	if err == nil {
		m.track(sb, rec)
		m.event(rec.ID, rec.KeyID, audit.KindAdopt, map[string]any{"checkpointed": true})
		m.log.Info("checkpointed sandbox adopted", "sandbox", rec.ID)
		return true
	}
	m.log.Warn("checkpoint unusable after the restart; the sandbox resumes from its files", "sandbox", rec.ID, "err", err)
	m.event(rec.ID, rec.KeyID, audit.KindCheckpoint, map[string]any{"usable": false, "error": err.Error()})
	_ = os.RemoveAll(dir)
	rec.PauseKind, rec.AgentPID, rec.AgentStart, rec.NetSlot = PauseFiles, 0, 0, -1
	_ = m.cfg.Store.UpdateSandbox(rec)
	return false
}

func (m *Manager) adoptCheckpointed(rec *store.Sandbox, dir string) (wall.Sandbox, error) {
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("no checkpoint at %s", dir)
	}
	d, err := m.cfg.Host.Driver(rec.Wall)
	if err != nil {
		return nil, err
	}
	c, ok := d.(wall.Checkpointer)
	if !ok {
		return nil, fmt.Errorf("the %s wall keeps no checkpoints", rec.Wall)
	}
	if err := c.CheckpointsMissing(); err != nil {
		return nil, err
	}
	policy, err := DecodePolicy(rec.Network)
	if err != nil {
		return nil, err
	}
	opts := sandbox.Options{ID: rec.ID, Token: rec.AccessToken, Wall: rec.Wall, Template: rec.TemplateID, Env: rec.EnvVars,
		CPUs: rec.CPUs, Memory: rec.Memory, Disk: rec.Disk, Pids: rec.Pids, Net: policy, Max: m.cfg.Max}
	ctx, cancel := context.WithTimeout(context.Background(), checkpointOps)
	defer cancel()
	// The slot is held meanwhile: the network's first setup (in Begin)
	// removes the interfaces and rules of every slot nobody holds.
	var hold *state.IDRange
	if rec.NetSlot >= 0 {
		if hold, err = state.ReserveSlot(rec.NetSlot); err != nil {
			return nil, err
		}
	}
	p, err := m.cfg.Host.Begin(ctx, &opts)
	hold.Close() // the wall takes the slot next
	if err != nil {
		return nil, err
	}
	return c.AdoptCheckpointed(ctx, p.Spec(), rec.NetSlot, dir)
}

// checkpointedMidPause says what a crash in the midst of a pause with
// memory on a wall that checkpoints left of a sandbox recorded as running
// (its files saved, its checkpoint maybe made): "" when nothing (it was
// not being paused), else the pause kind it now has: checkpoint when its
// checkpoint is whole, else files (whatever runs of it is removed).
func (m *Manager) checkpointedMidPause(rec *store.Sandbox) string {
	if _, err := os.Stat(m.savedFiles(rec.ID)); err != nil {
		return ""
	}
	d, err := m.cfg.Host.Driver(rec.Wall)
	if err != nil {
		return ""
	}
	if c, ok := d.(wall.Checkpointer); !ok || c.CheckpointsMissing() != nil {
		return "" // a wall that freezes: its sandbox is thawed
	}
	if fi, err := os.Stat(m.checkpointDir(rec.ID)); err == nil && fi.IsDir() {
		return PauseCheckpoint
	}
	return PauseFiles
}

// removeStaleCheckpoints removes the checkpoints a crash left behind: half
// written, or of a sandbox no longer checkpointed (resumed or killed as
// the daemon died).
func (m *Manager) removeStaleCheckpoints() {
	base := filepath.Join(m.cfg.Data, "checkpoints")
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		id := e.Name()
		if filepath.Ext(id) != ".part" {
			if rec, err := m.cfg.Store.GetSandbox(id); err == nil && rec.State == store.StatePaused && rec.PauseKind == PauseCheckpoint {
				continue
			}
		}
		m.log.Info("removing a stale checkpoint", "name", id)
		_ = os.RemoveAll(filepath.Join(base, id))
	}
}
