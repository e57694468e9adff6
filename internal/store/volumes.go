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

// Volume is one row of the volumes table: a key's named file system.
type Volume struct {
	ID        string // [a-z0-9]+, cage's
	KeyID     string
	Name      string // unique per key
	Token     string // bearer token of its content API (secret)
	Size      int64  // bytes
	CreatedAt time.Time
}

// VolumeMount is a volume a sandbox mounts, as its record keeps it.
type VolumeMount struct {
	ID   string `json:"id"`
	Name string `json:"name"`
	Path string `json:"path"`
}

func encodeMounts(m []VolumeMount) (string, error) {
	if len(m) == 0 {
		return "[]", nil
	}
	b, err := json.Marshal(m)
	return string(b), err
}

func decodeMounts(s string) ([]VolumeMount, error) {
	if s == "" || s == "[]" {
		return nil, nil
	}
	var m []VolumeMount
	err := json.Unmarshal([]byte(s), &m)
	return m, err
}

const volumeCols = `id, key_id, name, token, size, created_at`

// InsertVolume adds a volume; ErrConflict when its key has one of its name.
func (s *Store) InsertVolume(v *Volume) error {
	if v == nil || !validID(v.ID) {
		return fmt.Errorf("store: insert volume: invalid id")
	}
	_, err := s.db.ExecContext(context.Background(), "INSERT INTO volumes ("+volumeCols+") VALUES (?, ?, ?, ?, ?, ?)",
		v.ID, v.KeyID, v.Name, v.Token, v.Size, nanos(v.CreatedAt))
	if err != nil && strings.Contains(err.Error(), "UNIQUE") {
		return fmt.Errorf("store: volume %q: %w", v.Name, ErrConflict)
	}
	if err != nil {
		return fmt.Errorf("store: insert volume %s: %w", v.ID, err)
	}
	return nil
}

func scanVolume(r scanner) (*Volume, error) {
	var v Volume
	var created int64
	if err := r.Scan(&v.ID, &v.KeyID, &v.Name, &v.Token, &v.Size, &created); err != nil {
		return nil, err
	}
	v.CreatedAt = fromNanos(created)
	return &v, nil
}

// GetVolume returns a volume by id; keyID "" is any key's, else a volume
// of another key is ErrNotFound.
func (s *Store) GetVolume(keyID, id string) (*Volume, error) {
	v, err := scanVolume(s.db.QueryRowContext(context.Background(), "SELECT "+volumeCols+" FROM volumes WHERE id = ?", id))
	if errors.Is(err, sql.ErrNoRows) || (err == nil && keyID != "" && v.KeyID != keyID) {
		return nil, fmt.Errorf("store: volume %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get volume %s: %w", id, err)
	}
	return v, nil
}

// VolumeByName returns a key's volume by its name.
func (s *Store) VolumeByName(keyID, name string) (*Volume, error) {
	v, err := scanVolume(s.db.QueryRowContext(context.Background(),
		"SELECT "+volumeCols+" FROM volumes WHERE key_id = ? AND name = ?", keyID, name))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: volume %q: %w", name, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get volume %q: %w", name, err)
	}
	return v, nil
}

// ListVolumes returns a key's volumes, oldest first ("" key: every key's).
func (s *Store) ListVolumes(keyID string) ([]*Volume, error) {
	q, args := "SELECT "+volumeCols+" FROM volumes", []any{}
	if keyID != "" {
		q += " WHERE key_id = ?"
		args = append(args, keyID)
	}
	rows, err := s.db.QueryContext(context.Background(), q+" ORDER BY created_at, id", args...)
	if err != nil {
		return nil, fmt.Errorf("store: list volumes: %w", err)
	}
	defer rows.Close()
	var out []*Volume
	for rows.Next() {
		v, err := scanVolume(rows)
		if err != nil {
			return nil, fmt.Errorf("store: list volumes: %w", err)
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// CountVolumes is how many volumes a key has.
func (s *Store) CountVolumes(keyID string) (int, error) {
	var n int
	err := s.db.QueryRowContext(context.Background(), "SELECT COUNT(*) FROM volumes WHERE key_id = ?", keyID).Scan(&n)
	return n, err
}

// DeleteVolume removes a volume's row.
func (s *Store) DeleteVolume(id string) error {
	res, err := s.db.ExecContext(context.Background(), "DELETE FROM volumes WHERE id = ?", id)
	if err != nil {
		return fmt.Errorf("store: delete volume %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("store: volume %s: %w", id, ErrNotFound)
	}
	return nil
}

// SandboxesMounting returns the ids of the sandboxes (running, paused or
// being created) whose records mount volume id.
func (s *Store) SandboxesMounting(id string) ([]string, error) {
	rows, err := s.db.QueryContext(context.Background(),
		"SELECT id, volume_mounts FROM sandboxes WHERE volume_mounts != '[]' AND volume_mounts LIKE ?", "%"+id+"%")
	if err != nil {
		return nil, fmt.Errorf("store: sandboxes mounting %s: %w", id, err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var sid, mounts string
		if err := rows.Scan(&sid, &mounts); err != nil {
			return nil, err
		}
		ms, err := decodeMounts(mounts)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: volume mounts: %w", sid, err)
		}
		for _, m := range ms {
			if m.ID == id {
				out = append(out, sid)
				break
			}
		}
	}
	return out, rows.Err()
}
