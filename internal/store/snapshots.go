package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Snapshot is a sandbox's files saved under an id (and, optionally, a
// name), to start new sandboxes from.
type Snapshot struct {
	ID         string // snapNNN...
	KeyID      string
	SandboxID  string // the sandbox it was taken of
	Name       string // "" for none; unique per key
	TemplateID string // the template that sandbox started from
	Wall       string
	Kind       string // "files"
	Size       int64  // bytes of the archive
	CreatedAt  time.Time
	Spec       SnapshotSpec
}

// SnapshotSpec is what a sandbox started from the snapshot gets unless its
// request says otherwise.
type SnapshotSpec struct {
	CPUs    float64           `json:"cpus"`
	Memory  int64             `json:"memory"`
	Disk    int64             `json:"disk"`
	Pids    int64             `json:"pids"`
	EnvVars map[string]string `json:"env_vars,omitempty"`
	Network string            `json:"network,omitempty"` // the policy as the sandbox record keeps it
	// HTTPSPorts are the ports the proxy reached over TLS (E2B's network.httpsPorts).
	HTTPSPorts []int `json:"https_ports,omitempty"`
}

const snapshotCols = `id, key_id, sandbox_id, name, template_id, wall, kind, size, created_at, spec`

// InsertSnapshot adds a snapshot; ErrConflict when its key has the name.
func (s *Store) InsertSnapshot(sn *Snapshot) error {
	spec, err := json.Marshal(sn.Spec)
	if err != nil {
		return err
	}
	_, err = s.db.ExecContext(context.Background(), "INSERT INTO snapshots ("+snapshotCols+") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
		sn.ID, sn.KeyID, sn.SandboxID, sn.Name, sn.TemplateID, sn.Wall, sn.Kind, sn.Size, nanos(sn.CreatedAt), string(spec))
	if err != nil && strings.Contains(err.Error(), "UNIQUE") {
		return fmt.Errorf("store: snapshot %q: %w", sn.Name, ErrConflict)
	}
	if err != nil {
		return fmt.Errorf("store: insert snapshot %s: %w", sn.ID, err)
	}
	return nil
}

func scanSnapshot(r scanner) (*Snapshot, error) {
	var sn Snapshot
	var created int64
	var spec string
	if err := r.Scan(&sn.ID, &sn.KeyID, &sn.SandboxID, &sn.Name, &sn.TemplateID, &sn.Wall, &sn.Kind, &sn.Size, &created, &spec); err != nil {
		return nil, err
	}
	sn.CreatedAt = fromNanos(created)
	if err := json.Unmarshal([]byte(spec), &sn.Spec); err != nil {
		return nil, fmt.Errorf("snapshot %s: spec: %w", sn.ID, err)
	}
	return &sn, nil
}

// GetSnapshot returns a key's snapshot by id, or by name when id is not
// one ("" key: any key's).
func (s *Store) GetSnapshot(keyID, idOrName string) (*Snapshot, error) {
	q := "SELECT " + snapshotCols + " FROM snapshots WHERE (id = ? OR (name = ? AND name != ''))"
	args := []any{idOrName, idOrName}
	if keyID != "" {
		q += " AND key_id = ?"
		args = append(args, keyID)
	}
	sn, err := scanSnapshot(s.db.QueryRowContext(context.Background(), q+" LIMIT 1", args...))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: snapshot %s: %w", idOrName, ErrNotFound)
	}
	return sn, err
}

// SnapshotFilter selects a page of a key's snapshots, newest first.
type SnapshotFilter struct {
	KeyID     string
	SandboxID string
	Name      string
	Limit     int
	Cursor    string
}

// ListSnapshots returns a page of snapshots and the cursor of the next.
func (s *Store) ListSnapshots(f SnapshotFilter) ([]*Snapshot, string, error) {
	where, args := []string{"key_id = ?"}, []any{f.KeyID}
	if f.SandboxID != "" {
		where, args = append(where, "sandbox_id = ?"), append(args, f.SandboxID)
	}
	if f.Name != "" {
		where, args = append(where, "name = ?"), append(args, f.Name)
	}
	if f.Cursor != "" {
		at, id, err := decodeCursor(f.Cursor)
		if err != nil {
			return nil, "", fmt.Errorf("store: list snapshots: %w", err)
		}
		where, args = append(where, "(created_at, id) < (?, ?)"), append(args, at, id)
	}
	q := "SELECT " + snapshotCols + " FROM snapshots WHERE " + strings.Join(where, " AND ") + " ORDER BY created_at DESC, id DESC"
	if f.Limit > 0 {
		q, args = q+" LIMIT ?", append(args, f.Limit+1)
	}
	rows, err := s.db.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, "", fmt.Errorf("store: list snapshots: %w", err)
	}
	defer rows.Close()
	var out []*Snapshot
	for rows.Next() {
		sn, err := scanSnapshot(rows)
		if err != nil {
			return nil, "", err
		}
		out = append(out, sn)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := ""
	if f.Limit > 0 && len(out) > f.Limit {
		out = out[:f.Limit]
		last := out[len(out)-1]
		next = encodeCursor(nanos(last.CreatedAt), last.ID)
	}
	return out, next, nil
}

// DeleteSnapshot removes a snapshot's record; ErrNotFound if none.
func (s *Store) DeleteSnapshot(id string) error {
	res, err := s.db.ExecContext(context.Background(), "DELETE FROM snapshots WHERE id = ?", id)
	if err != nil {
		return fmt.Errorf("store: delete snapshot %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("store: snapshot %s: %w", id, ErrNotFound)
	}
	return nil
}
