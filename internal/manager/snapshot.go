package manager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// A snapshot is a sandbox's files (what a pause without memory keeps),
// saved while the sandbox runs on: its processes are halted for the time
// the agent reads its files, then go on. New sandboxes start from it by
// naming it as their template: the same template with the snapshot's files
// restored, on any wall (the archive is made and unmade by the agent), each
// with an identity of its own. Snapshots keep files, not memory, on every
// wall; a sandbox started from one runs none of the processes that ran.

// snapshotNamespace prefixes named snapshots' ids, as E2B's team namespace.
const snapshotNamespace = "cage"

// snapshotTag ends every snapshot id, as E2B's default tag.
const snapshotTag = ":default"

// Compiled at first use: a counted repetition compiles into a program of
// its size, work every cage process (cage run included) paid at its start.
var snapshotName = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_-]{0,63}$`) })

// SnapshotRef is the id clients know a snapshot by (E2B's snapshotID):
// "cage/NAME:default" when named, else "ID:default".
func SnapshotRef(sn *store.Snapshot) string {
	if sn.Name != "" {
		return snapshotNamespace + "/" + sn.Name + snapshotTag
	}
	return sn.ID + snapshotTag
}

// SnapshotNames are E2B's names of a snapshot ("cage/NAME"; none unnamed).
func SnapshotNames(sn *store.Snapshot) []string {
	if sn.Name == "" {
		return []string{}
	}
	return []string{snapshotNamespace + "/" + sn.Name}
}

// IsSnapshotRef says whether a template reference is a snapshot's in form.
func IsSnapshotRef(ref string) bool {
	return strings.HasSuffix(ref, snapshotTag) || strings.HasPrefix(ref, snapshotNamespace+"/")
}

// snapshotKey reads a client's reference to a snapshot: its ref, id or name.
func snapshotKey(ref string) string {
	ref = strings.TrimSuffix(ref, snapshotTag)
	return strings.TrimPrefix(ref, snapshotNamespace+"/")
}

func (m *Manager) snapshotFile(id string) string {
	return filepath.Join(m.cfg.Data, "snapshots", id+".tar")
}

// Snapshot saves a running sandbox's files as a snapshot, named or not;
// the sandbox runs on with the same id and end time.
func (m *Manager) Snapshot(ctx context.Context, keyID, id, name string) (*store.Snapshot, error) {
	if name != "" && !snapshotName().MatchString(name) {
		return nil, fmt.Errorf("%w: snapshot name %q: want letters, digits, - and _ (at most 64)", ErrInvalid, name)
	}
	unlock, err := m.lockOwned(keyID, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	if rec.State != store.StateRunning {
		return nil, fmt.Errorf("%w: sandbox %q is %s; snapshot a running sandbox", ErrConflict, id, rec.State)
	}
	sb, ok := m.tracked(id)
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	if name != "" {
		if _, err := m.cfg.Store.GetSnapshot(rec.KeyID, name); err == nil {
			return nil, fmt.Errorf("%w: a snapshot is named %q already", ErrConflict, name)
		}
	}
	sn := &store.Snapshot{ID: "snap" + ids.NewID(), KeyID: rec.KeyID, SandboxID: id, Name: name, TemplateID: rec.TemplateID,
		Wall: rec.Wall, Kind: PauseFiles, CreatedAt: time.Now(),
		Spec: store.SnapshotSpec{CPUs: rec.CPUs, Memory: rec.Memory, Disk: rec.Disk, Pids: rec.Pids, EnvVars: rec.EnvVars, Network: rec.Network,
			HTTPSPorts: rec.HTTPSPorts}}
	path := m.snapshotFile(sn.ID)
	// Its archive takes its bytes of the team's disk quota (the bound of
	// a key without a team, or of a team without a disk quota, keydisk.go): at most what the quota has left, held while it is written and given back as its
	// record (which counts its size) is made.
	limit := archiveLimit(rec.Disk)
	q, got, err := m.reserveDisk(rec.KeyID, limit)
	if err != nil {
		return nil, err
	}
	defer q.release()
	if err := m.saveFilesUpTo(ctx, sb, got, path); err != nil {
		if got < limit && errors.Is(err, agentclient.ErrTooLarge) {
			whose := "its team's disk quota (without one, its bound on the host's disk)"
			if !strings.HasPrefix(rec.KeyID, store.TeamPrefix) {
				whose = "its key's bound on the host's disk"
			}
			return nil, &QuotaError{Quota: "disk", Msg: fmt.Sprintf("sandbox %s's files are more than the %d MiB %s has left; delete one of its snapshots or kill one of its sandboxes first", id, got>>20, whose)}
		}
		return nil, fmt.Errorf("snapshot sandbox %s: %w", id, err)
	}
	if fi, err := os.Stat(path); err == nil {
		sn.Size = fi.Size()
	}
	if err := q.record(func() error { return m.cfg.Store.InsertSnapshot(sn) }); err != nil {
		_ = os.Remove(path)
		if errors.Is(err, store.ErrConflict) {
			return nil, fmt.Errorf("%w: a snapshot is named %q already", ErrConflict, name)
		}
		return nil, err
	}
	m.event(id, rec.KeyID, audit.KindSnapshot, map[string]any{"snapshot": SnapshotRef(sn), "bytes": sn.Size})
	m.log.Info("sandbox snapshotted", "sandbox", id, "snapshot", sn.ID, "bytes", sn.Size)
	return sn, nil
}

// Snapshots lists a key's snapshots, newest first.
func (m *Manager) Snapshots(f store.SnapshotFilter) ([]*store.Snapshot, string, error) {
	if f.Name != "" {
		f.Name = snapshotKey(f.Name)
	}
	items, next, err := m.cfg.Store.ListSnapshots(f)
	if errors.Is(err, store.ErrInvalidCursor) {
		return nil, "", fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return items, next, err
}

// DeleteSnapshot removes a key's snapshot (by its ref, id or name) and its
// files.
func (m *Manager) DeleteSnapshot(keyID, ref string) error {
	sn, err := m.cfg.Store.GetSnapshot(keyID, snapshotKey(ref))
	if errors.Is(err, store.ErrNotFound) {
		return fmt.Errorf("%w: snapshot %q", ErrNotFound, ref)
	}
	if err != nil {
		return err
	}
	if err := m.cfg.Store.DeleteSnapshot(sn.ID); err != nil {
		return err
	}
	if err := os.Remove(m.snapshotFile(sn.ID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		m.log.Warn("remove a snapshot's files", "snapshot", sn.ID, "err", err)
	}
	return nil
}

// fromSnapshot turns a create naming a key's snapshot as its template into
// a create of the snapshot's template, with its limits and environment
// where the request gives none, and returns the snapshot (nil when the
// template names none: a name that is a snapshot's in form but no
// snapshot's is a template not found).
func (m *Manager) fromSnapshot(req *CreateRequest) (*store.Snapshot, error) {
	t := req.Template
	if !strings.HasSuffix(t, snapshotTag) && !strings.HasPrefix(t, snapshotNamespace+"/") {
		return nil, nil // a template's name, not a snapshot's
	}
	sn, err := m.cfg.Store.GetSnapshot(req.KeyID, snapshotKey(req.Template))
	if errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("%w: template or snapshot %q", sandbox.ErrNotFound, t)
	}
	if err != nil {
		return nil, err
	}
	req.Template = sn.TemplateID
	if req.CPUs == 0 {
		req.CPUs = sn.Spec.CPUs
	}
	if req.Memory == 0 {
		req.Memory = sn.Spec.Memory
	}
	if req.Disk == 0 {
		req.Disk = sn.Spec.Disk
	}
	if req.Pids == 0 {
		req.Pids = sn.Spec.Pids
	}
	if req.HTTPSPorts == nil {
		req.HTTPSPorts = sn.Spec.HTTPSPorts
	}
	env := map[string]string{}
	for k, v := range sn.Spec.EnvVars {
		env[k] = v
	}
	for k, v := range req.Env {
		env[k] = v
	}
	req.Env = env
	return sn, nil
}

// restoreSnapshot restores a snapshot's files into a new sandbox.
func (m *Manager) restoreSnapshot(ctx context.Context, sn *store.Snapshot, c *agentclient.Client) error {
	f, err := os.Open(m.snapshotFile(sn.ID))
	if err != nil {
		return fmt.Errorf("snapshot %s: its files: %w", sn.ID, err)
	}
	defer f.Close()
	if err := c.Restore(ctx, io.Reader(f)); err != nil {
		return fmt.Errorf("snapshot %s: restore: %w", sn.ID, err)
	}
	return nil
}
