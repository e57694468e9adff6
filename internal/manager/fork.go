package manager

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/store"
)

// MaxFork bounds the sandboxes one fork makes.
const MaxFork = 100

// forkParallel is how many of a fork's sandboxes start at once (the
// manager's create slots bound it further).
const forkParallel = 4

// Forked is the outcome of one sandbox of a fork: the sandbox, or why it
// did not start.
type Forked struct {
	Sandbox *store.Sandbox
	Err     error
}

// Fork makes count sandboxes from a running sandbox, E2B's fork: the
// sandbox is snapshotted once (its processes halted while its files are
// read, then going on with the same id and end time), count sandboxes
// start from that snapshot on the same wall, with its template, limits,
// environment, network policy, metadata and lifecycle, each with an
// identity of its own and the timeout d, and the snapshot is deleted. A
// fork keeps files, not processes (as every cage snapshot), and mounts no
// volume. Each sandbox succeeds or fails on its own; an error returned
// means none was attempted.
func (m *Manager) Fork(ctx context.Context, keyID, id string, count int, d time.Duration) ([]Forked, error) {
	if count < 1 || count > MaxFork {
		return nil, fmt.Errorf("%w: count %d: want 1 to %d", ErrInvalid, count, MaxFork)
	}
	if err := m.checkTimeout(d); err != nil {
		return nil, err
	}
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	policy, err := DecodePolicy(rec.Network)
	if err != nil {
		return nil, err
	}
	sn, err := m.Snapshot(ctx, keyID, id, "")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := m.DeleteSnapshot(rec.KeyID, sn.ID); err != nil {
			m.log.Warn("fork: delete its snapshot", "sandbox", id, "snapshot", sn.ID, "err", err)
		}
	}()
	req := CreateRequest{
		Wall: rec.Wall, KeyID: rec.KeyID, Template: SnapshotRef(sn), Timeout: d,
		Metadata: rec.Metadata, Net: policy, PublicTraffic: rec.PublicTraffic, HTTPSPorts: rec.HTTPSPorts,
		AutoPause: rec.AutoPause, AutoPauseMemory: rec.AutoPauseMemory, AutoResume: rec.AutoResume,
	}
	out := make([]Forked, count)
	sem := make(chan struct{}, forkParallel)
	var wg sync.WaitGroup
	for i := range out {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			r := req
			r.Metadata = copyMap(req.Metadata)
			out[i].Sandbox, out[i].Err = m.Create(ctx, r)
		}()
	}
	wg.Wait()
	made, started := 0, []string{}
	for _, f := range out {
		if f.Err == nil {
			made++
			started = append(started, f.Sandbox.ID)
		}
	}
	m.event(id, rec.KeyID, audit.KindFork, map[string]any{"asked": count, "started": started})
	m.log.Info("sandbox forked", "sandbox", id, "asked", count, "started", made)
	return out, nil
}

func copyMap(in map[string]string) map[string]string {
	if in == nil {
		return nil
	}
	out := make(map[string]string, len(in))
	for k, v := range in {
		out[k] = v
	}
	return out
}
