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

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

// A paused sandbox is one of three kinds (and checkpoint, checkpoint.go,
// is what memory is on the walls that checkpoint):
//
//   - memory: its cgroup frozen, on process and runc (processes and memory kept
//     in RAM, CPU zero), after its files were saved as below. It survives a
//     restart of the daemon, which adopts it frozen; should it be lost (a
//     restart of the host), it becomes a sandbox paused with its files.
//     Resume thaws it: processes go on where they stood.
//   - files: its writable files archived by its agent into
//     DATA/paused/ID.tar, then the sandbox destroyed (every byte of its RAM
//     released). Resume starts a new sandbox with the same id, token,
//     template, limits and network, and restores the files into it;
//     processes are gone. The archive survives anything but the data
//     directory's loss.
const (
	PauseMemory = "memory"
	PauseFiles  = "files"
)

// DefaultPausedRetention is how long a paused sandbox is kept (E2B: 30 days).
const DefaultPausedRetention = 30 * 24 * time.Hour

// transition serializes the lifecycle changes of one sandbox (pause,
// resume, kill, snapshot) without holding the manager's lock. A lock
// lives as long as someone holds or waits for it: the ids are the
// callers' (before, one entry per id ever named stayed for good, any
// tenant's request for any id, 64 KiB each, made one).
func (m *Manager) transition(id string) func() {
	l, forget := m.transitionRef(id)
	l.Lock()
	return func() { l.Unlock(); forget() }
}

// tryTransition is transition for the sweeps: it takes sandbox id's lock
// only when nobody holds it, and reports false (nothing taken) otherwise.
// A sweep is one loop for every tenant, and a lock may be held as long as
// a tenant makes it: a resume holds it through its agent's restore, which
// a tree of the sandbox's making stretches to hours, for as long as the
// request is kept open. A sandbox whose lock is held is the next sweep's.
func (m *Manager) tryTransition(id string) (func(), bool) {
	l, forget := m.transitionRef(id)
	if !l.TryLock() {
		forget()
		return nil, false
	}
	return func() { l.Unlock(); forget() }, true
}

// transitionRef counts one more holder or waiter of sandbox id's lock,
// made if needed, and returns it with the function that counts it off
// (the last one's forgets the lock).
func (m *Manager) transitionRef(id string) (*transitionLock, func()) {
	m.transMu.Lock()
	l := m.transitions[id]
	if l == nil {
		l = &transitionLock{}
		m.transitions[id] = l
	}
	l.refs++
	m.transMu.Unlock()
	return l, func() {
		m.transMu.Lock()
		if l.refs--; l.refs == 0 {
			delete(m.transitions, id)
		}
		m.transMu.Unlock()
	}
}

type transitionLock struct {
	sync.Mutex
	refs int // holders and waiters (guarded by Manager.transMu)
}

// lockOwned takes sandbox id's transition lock once keyID is seen to own
// it: a malformed id or another tenant's sandbox is ErrNotFound, with no
// lock taken or waited for.
func (m *Manager) lockOwned(keyID, id string) (func(), error) {
	if _, err := m.Get(keyID, id); err != nil {
		return nil, err
	}
	return m.transition(id), nil
}

func (m *Manager) savedFiles(id string) string {
	return filepath.Join(m.cfg.Data, "paused", id+".tar")
}

// Pause pauses a running sandbox, keeping its memory or only its files.
// Pausing a paused sandbox is ErrConflict.
func (m *Manager) Pause(ctx context.Context, keyID, id string, keepMemory bool) error {
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return err
	}
	defer unlock()
	rec, err := m.Get(keyID, id)
	if err != nil {
		return err
	}
	if rec.State == store.StatePaused {
		return fmt.Errorf("%w: sandbox %q is already paused", ErrConflict, id)
	}
	return m.pause(ctx, rec, keepMemory)
}

func (m *Manager) pause(ctx context.Context, rec *store.Sandbox, keepMemory bool) error {
	m.mu.Lock()
	e := m.live[rec.ID]
	m.mu.Unlock()
	if e == nil {
		return fmt.Errorf("%w: sandbox %q", ErrNotFound, rec.ID)
	}
	cp := m.checkpointable(rec.Wall, e.sb)
	need := store.Usage{Paused: 1}
	if keepMemory && cp != nil {
		// Its checkpoint, up to its memory, is written to the host's
		// disk: it takes that much of its team's disk quota while paused.
		need.Disk = rec.Memory
	}
	q, err := m.reserve(rec.KeyID, need)
	if err != nil {
		return err
	}
	defer q.release()
	// A key without a team: its files and its checkpoint go to the host's
	// disk, within the key's bound.
	kq, _, err := m.reserveKeyDisk(rec.KeyID, rec.Disk+need.Disk, false)
	if err != nil {
		return err
	}
	defer kq.release()
	// The files first, in every case: a frozen sandbox lost with the host
	// resumes from them.
	if err := m.saveFiles(ctx, e.sb, rec.Disk, m.savedFiles(rec.ID)); err != nil {
		return fmt.Errorf("pause sandbox %s: %w", rec.ID, err)
	}
	if keepMemory && cp != nil {
		if err := m.pauseCheckpoint(ctx, rec, e, cp); err != nil {
			_ = os.Remove(m.savedFiles(rec.ID))
			return fmt.Errorf("pause sandbox %s: %w", rec.ID, err)
		}
		return nil
	}
	if keepMemory {
		if err := e.sb.Cgroup().Freeze(ctx); err != nil {
			_ = os.Remove(m.savedFiles(rec.ID))
			return fmt.Errorf("pause sandbox %s: %w", rec.ID, err)
		}
		e.timer.Stop()
		e.setPaused(true)
		rec.State, rec.PausedAt, rec.PauseKind = store.StatePaused, time.Now(), PauseMemory
		if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
			_ = e.sb.Cgroup().Thaw()
			_ = os.Remove(m.savedFiles(rec.ID))
			e.setPaused(false)
			e.timer.Reset(time.Until(rec.EndAt))
			return err
		}
		m.event(rec.ID, rec.KeyID, audit.KindPause, map[string]any{"kind": PauseMemory})
		m.log.Info("sandbox paused", "sandbox", rec.ID, "kind", PauseMemory)
		return nil
	}
	rec.State, rec.PausedAt, rec.PauseKind = store.StatePaused, time.Now(), PauseFiles
	rec.AgentPID, rec.AgentStart, rec.NetSlot = 0, 0, -1
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		_ = os.Remove(m.savedFiles(rec.ID))
		return err
	}
	m.forget(rec.ID, e)
	if err := e.sb.Destroy(); err != nil {
		m.log.Warn("destroy after saving its files", "sandbox", rec.ID, "err", err)
	}
	m.event(rec.ID, rec.KeyID, audit.KindPause, map[string]any{"kind": PauseFiles})
	m.log.Info("sandbox paused", "sandbox", rec.ID, "kind", PauseFiles)
	return nil
}

// forget drops a tracked sandbox without destroying it.
func (m *Manager) forget(id string, e *entry) {
	m.mu.Lock()
	if m.live[id] == e {
		delete(m.live, id)
	}
	m.mu.Unlock()
	e.timer.Stop()
}

// archiveLimit bounds a sandbox's archive: its files fit its disk, and tar
// adds at most a header (and padding) per inode of it.
func archiveLimit(disk int64) int64 { return disk + disk/4 + 16<<20 }

// archiveTime is how long the host gives a sandbox's agent to hand over
// an archive of at most limit bytes: archiveBase, and a second for each
// archiveRate bytes of the bound. The agent is inside the wall: one that
// sent its archive a byte at a time (within the bound) held the pause,
// and the sandbox's transition lock with it, for as long as the request
// was kept open, and the sandbox ran on past its timeout, whose timer
// waits for that lock, and past its key's revocation, whose sweep passes
// a held lock by (found by review, 2026-12-05).
func archiveTime(limit int64) time.Duration {
	return archiveBase + time.Duration(limit/archiveRate)*time.Second
}

// archiveBase and archiveRate: see archiveTime (a variable for the tests).
var archiveBase = 5 * time.Minute

const archiveRate = 16 << 20

// saveFiles has the sandbox's agent archive its writable files (its other
// processes halted meanwhile) into path. Nothing is left on failure, and
// the sandbox goes on as before.
func (m *Manager) saveFiles(ctx context.Context, sb wall.Sandbox, disk int64, path string) error {
	return m.saveFilesUpTo(ctx, sb, archiveLimit(disk), path)
}

// saveFilesUpTo is saveFiles with the archive bounded to limit bytes
// (agentclient.ErrTooLarge past it).
func (m *Manager) saveFilesUpTo(ctx context.Context, sb wall.Sandbox, limit int64, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(path), &fs); err == nil {
		if free := int64(fs.Bavail) * fs.Bsize; free < limit {
			return fmt.Errorf("%w: not enough disk space to save its files (%d MiB free under %s, up to %d MiB needed)",
				sandbox.ErrUnavailable, free>>20, filepath.Dir(path), limit>>20)
		}
	}
	tmp := path + ".part"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	within := archiveTime(limit)
	actx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	_, err = c.Archive(actx, f, "stop", limit)
	if err != nil && actx.Err() != nil && ctx.Err() == nil {
		err = fmt.Errorf("%w: its agent did not hand over its files within %v; it runs on", ErrConflict, within)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		if errors.Is(err, unix.ENOSPC) {
			return fmt.Errorf("%w: the disk filled while saving its files", sandbox.ErrUnavailable)
		}
		return err
	}
	return nil
}

// Resume resumes a paused sandbox for d from now (a running one is only
// extended, never shortened). keepMemory false resumes a memory-paused
// sandbox without its processes (killed, files kept). resumed says whether
// it was paused.
func (m *Manager) Resume(ctx context.Context, keyID, id string, d time.Duration, keepMemory bool) (*store.Sandbox, bool, error) {
	if err := m.checkTimeout(d); err != nil {
		return nil, false, err
	}
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return nil, false, err
	}
	defer unlock()
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, false, err
	}
	if rec.State != store.StatePaused {
		if time.Until(rec.EndAt) < d {
			rec, err = m.setTimeout(keyID, id, d)
		}
		return rec, false, err
	}
	q, err := m.reserve(rec.KeyID, resumeNeed(rec))
	if err != nil {
		return nil, false, err
	}
	defer q.release()
	start, kind := time.Now(), rec.PauseKind
	err = m.resume(ctx, rec, d, keepMemory)
	m.cfg.Metrics.Resumed(kind, time.Since(start), err)
	if err != nil {
		return nil, false, err
	}
	return rec, true, nil
}

func (m *Manager) resume(ctx context.Context, rec *store.Sandbox, d time.Duration, keepMemory bool) error {
	if rec.PauseKind == PauseFiles {
		return m.resumeFiles(ctx, rec, d)
	}
	if rec.PauseKind == PauseCheckpoint {
		return m.resumeCheckpoint(ctx, rec, d, keepMemory)
	}
	m.mu.Lock()
	e := m.live[rec.ID]
	m.mu.Unlock()
	if e == nil {
		return fmt.Errorf("%w: sandbox %q", ErrNotFound, rec.ID)
	}
	if err := e.sb.Cgroup().Thaw(); err != nil {
		return fmt.Errorf("resume sandbox %s: %w", rec.ID, err)
	}
	if !keepMemory {
		if err := killProcesses(ctx, e.sb); err != nil {
			m.log.Warn("resume without memory: kill the processes", "sandbox", rec.ID, "err", err)
		}
	}
	rec.State, rec.PausedAt, rec.PauseKind, rec.EndAt = store.StateRunning, time.Time{}, "", time.Now().Add(d)
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		return err
	}
	e.setPaused(false)
	e.timer.Reset(d)
	_ = os.Remove(m.savedFiles(rec.ID))
	m.event(rec.ID, rec.KeyID, audit.KindResume, map[string]any{"kind": PauseMemory})
	m.log.Info("sandbox resumed", "sandbox", rec.ID, "kind", PauseMemory)
	return nil
}

// resumeFiles starts the sandbox again, same id and token, from its
// template, and restores its saved files into it.
func (m *Manager) resumeFiles(ctx context.Context, rec *store.Sandbox, d time.Duration) error {
	saved, err := os.Open(m.savedFiles(rec.ID))
	if err != nil {
		return fmt.Errorf("resume sandbox %s: its saved files: %w", rec.ID, err)
	}
	defer saved.Close()
	if err := m.admit(); err != nil {
		return err
	}
	defer m.admitted()
	// A resume starts a sandbox as a create does, and waits for the same
	// slots (before, resumes did not: a tenant could resume its paused
	// sandboxes all at once, past the host's bound on starts).
	release, err := m.createSlot(ctx, rec.KeyID)
	if err != nil {
		return err
	}
	release = sync.OnceFunc(release)
	defer release()
	policy, err := DecodePolicy(rec.Network)
	if err != nil {
		return err
	}
	opts := sandbox.Options{ID: rec.ID, Token: rec.AccessToken, Wall: rec.Wall, Template: rec.TemplateID, Env: rec.EnvVars,
		CPUs: rec.CPUs, Memory: rec.Memory, Disk: rec.Disk, Pids: rec.Pids, Net: policy, Max: m.cfg.Max}
	unlockVolumes := sync.OnceFunc(m.lockVolumes(rec.KeyID, false))
	defer unlockVolumes()
	if opts.Volumes, err = m.reopenMounts(rec); err != nil {
		return err
	}
	defer closeVolumes(opts.Volumes)
	p, err := m.cfg.Host.Begin(ctx, &opts)
	if err != nil {
		return err
	}
	sb, err := p.Start(ctx)
	if err != nil {
		return err
	}
	// Started: the restore is the sandbox's own work, as long as its files
	// make it (a tree thousands of directories deep took its agent
	// minutes). It holds neither the host's create slots, which every
	// tenant's creates wait for, nor the volume lock, which every volume's
	// create and delete wait for (the paused record names its volumes, so
	// none of them is deleted meanwhile).
	release()
	unlockVolumes()
	c := agentclient.New(sb.Dial, sb.Token())
	err = c.Restore(ctx, saved)
	c.Close()
	if err != nil {
		_ = sb.Destroy()
		return fmt.Errorf("resume sandbox %s: restore its files: %w", rec.ID, err)
	}
	rec.State, rec.PausedAt, rec.PauseKind, rec.EndAt = store.StateRunning, time.Time{}, "", time.Now().Add(d)
	rec.AgentPID = sb.AgentPID()
	rec.AgentStart, _ = hostproc.StartTime(sb.AgentPID())
	setNetwork(rec, sb)
	if err := m.cfg.Store.UpdateSandbox(rec); err != nil {
		_ = sb.Destroy()
		return err
	}
	m.track(sb, rec)
	_ = os.Remove(m.savedFiles(rec.ID))
	m.event(rec.ID, rec.KeyID, audit.KindResume, map[string]any{"kind": PauseFiles})
	m.log.Info("sandbox resumed", "sandbox", rec.ID, "kind", PauseFiles)
	return nil
}

// timedOut is what a sandbox's end timer does: pause it where its
// lifecycle says so, else kill it.
func (m *Manager) timedOut(id string) {
	rec, err := m.cfg.Store.GetSandbox(id)
	if err == nil && rec.AutoPause && rec.State == store.StateRunning {
		unlock := m.transition(id)
		// Read again under the lock: a pause, resume or kill may have
		// ended while this waited, and what it stored is what stands.
		if rec, err = m.cfg.Store.GetSandbox(id); err != nil || rec.State != store.StateRunning || extended(rec) {
			unlock()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		err = m.pause(ctx, rec, rec.AutoPauseMemory)
		cancel()
		unlock()
		if err == nil {
			m.event(id, rec.KeyID, audit.KindTimeout, map[string]any{"action": "paused"})
			m.log.Info("sandbox paused at its timeout", "sandbox", id)
			return
		}
		m.log.Warn("pause at timeout failed; killing it", "sandbox", id, "err", err)
	}
	// Under the sandbox's transition lock, as a kill: a pause, resume or
	// snapshot in progress finishes first. The timer may have fired just
	// as a pause stopped it, and a destroy during a checkpoint raced the
	// wall's own teardown of the sandbox (the OCI wall's pidfd was closed
	// by both, the second time whatever file had taken its number). A
	// sandbox paused meanwhile does not time out.
	unlock := m.transition(id)
	defer unlock()
	if rec, err := m.cfg.Store.GetSandbox(id); err == nil && (rec.State == store.StatePaused || extended(rec)) {
		return
	}
	m.expire(id)
}

// extended says whether a sandbox whose end timer fired has an end later
// than that by now: a resume or a new timeout, while the timer's call
// waited for the transition lock, gave it one, and the timer they armed
// stands. (A second of margin: a timer fires at its end, not before.)
func extended(rec *store.Sandbox) bool {
	return time.Until(rec.EndAt) > time.Second
}

// killPaused removes a sandbox paused with its files: its record and its
// archive (there is nothing running). (A sandbox paused with its memory is
// removed as a running one is, and its archive with it: see remove.)
func (m *Manager) killPaused(rec *store.Sandbox, why string) error {
	m.metrics.forget(rec.ID)
	if err := os.Remove(m.savedFiles(rec.ID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		m.log.Warn("remove saved files", "sandbox", rec.ID, "err", err)
	}
	_ = os.RemoveAll(m.checkpointDir(rec.ID))
	if err := m.cfg.Store.DeleteSandbox(rec.ID); err != nil && !errors.Is(err, store.ErrNotFound) {
		return err
	}
	m.event(rec.ID, rec.KeyID, endKind(why), map[string]any{"reason": why, "paused": true})
	return nil
}

// expirePaused removes the paused sandboxes kept longer than the retention.
func (m *Manager) expirePaused() {
	recs, err := m.cfg.Store.AllSandboxes()
	if err != nil {
		return
	}
	for _, rec := range recs {
		if rec.State != store.StatePaused || time.Since(rec.PausedAt) < m.cfg.PausedRetention {
			continue
		}
		// Not waited for: a resume (or kill) holds it, and what it leaves
		// is the next sweep's.
		unlock, ok := m.tryTransition(rec.ID)
		if !ok {
			continue
		}
		// Read again under the lock: a resume that held it meanwhile made
		// the sandbox run (and tracked it), and removing it from what was
		// read before deleted a running sandbox's record, leaving it
		// beyond its owner, its quota and Kill.
		cur, err := m.cfg.Store.GetSandbox(rec.ID)
		if err != nil || cur.State != store.StatePaused || cur.PauseKind != rec.PauseKind || time.Since(cur.PausedAt) < m.cfg.PausedRetention {
			unlock()
			continue
		}
		rec = cur
		m.log.Info("paused sandbox expired", "sandbox", rec.ID, "paused", rec.PausedAt)
		if rec.PauseKind == PauseFiles {
			_ = m.killPaused(rec, "kept paused past the retention")
		} else {
			m.remove(rec.ID, "kept paused past the retention")
		}
		unlock()
	}
}

// killProcesses has sb's agent kill every process of the sandbox but
// itself, waiting at most killWithin: the agent is inside the wall, and
// one that never answered held a resume without memory, and the
// sandbox's lock, while the sandbox ran thawed with its end timer
// stopped, past its timeout and its key's revocation (found by review,
// 2026-12-05).
func killProcesses(ctx context.Context, sb wall.Sandbox) error {
	ctx, cancel := context.WithTimeout(ctx, killWithin)
	defer cancel()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	return c.KillAll(ctx)
}

// killWithin bounds killProcesses (a variable for the tests).
var killWithin = 30 * time.Second
