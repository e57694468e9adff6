package store

import (
	"context"
	"fmt"
	"time"
)

// Event is one entry of the audit trail.
type Event struct {
	ID        int64 // increases with every event, never reused
	SandboxID string
	Time      time.Time
	Kind      string
	Detail    string
}

// AddEvent appends an event to the audit trail. sandboxID may be "" for
// events about the daemon itself, and need not name an existing sandbox:
// the trail outlives the sandboxes it describes.
func (s *Store) AddEvent(sandboxID, kind, detail string) error {
	if kind == "" {
		return fmt.Errorf("store: add event: empty kind")
	}
	_, err := s.db.ExecContext(context.Background(),
		"INSERT INTO events (sandbox_id, time, kind, detail) VALUES (?, ?, ?, ?)",
		sandboxID, nanos(s.now()), kind, detail)
	if err != nil {
		return fmt.Errorf("store: add event: %w", err)
	}
	return nil
}

// AddEvents appends events in one transaction (times as given; zero is
// now): for bursts such as a sandbox's network records.
func (s *Store) AddEvents(evs []Event) error {
	if len(evs) == 0 {
		return nil
	}
	tx, err := s.db.BeginTx(context.Background(), nil)
	if err != nil {
		return fmt.Errorf("store: add events: %w", err)
	}
	defer tx.Rollback()
	stmt, err := tx.Prepare("INSERT INTO events (sandbox_id, time, kind, detail) VALUES (?, ?, ?, ?)")
	if err != nil {
		return fmt.Errorf("store: add events: %w", err)
	}
	defer stmt.Close()
	for _, e := range evs {
		if e.Kind == "" {
			return fmt.Errorf("store: add events: empty kind")
		}
		at := e.Time
		if at.IsZero() {
			at = s.now()
		}
		if _, err := stmt.Exec(e.SandboxID, nanos(at), e.Kind, e.Detail); err != nil {
			return fmt.Errorf("store: add events: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("store: add events: %w", err)
	}
	return nil
}

// Events returns the events of a sandbox, newest first (in the order they
// were added, whatever the clock did), at most limit of them (0 = all).
// sandboxID "" returns the whole trail, every sandbox's events included.
func (s *Store) Events(sandboxID string, limit int) ([]Event, error) {
	q := "SELECT id, sandbox_id, time, kind, detail FROM events"
	var args []any
	if sandboxID != "" {
		q += " WHERE sandbox_id = ?"
		args = append(args, sandboxID)
	}
	q += " ORDER BY id DESC"
	if limit > 0 {
		q += " LIMIT ?"
		args = append(args, limit)
	}
	rows, err := s.db.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, fmt.Errorf("store: events: %w", err)
	}
	defer rows.Close()
	var evs []Event
	for rows.Next() {
		var (
			e  Event
			at int64
		)
		if err := rows.Scan(&e.ID, &e.SandboxID, &at, &e.Kind, &e.Detail); err != nil {
			return nil, fmt.Errorf("store: events: %w", err)
		}
		e.Time = fromNanos(at)
		evs = append(evs, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: events: %w", err)
	}
	return evs, nil
}

// PruneEvents deletes the events older than before and returns how many
// went; the daemon can call it now and then to bound the trail.
func (s *Store) PruneEvents(before time.Time) (int64, error) {
	res, err := s.db.ExecContext(context.Background(), "DELETE FROM events WHERE time < ?", nanos(before))
	if err != nil {
		return 0, fmt.Errorf("store: prune events: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("store: prune events: %w", err)
	}
	return n, nil
}
