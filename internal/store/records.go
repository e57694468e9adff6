package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// Network records (every allowed and denied connection and DNS answer of a
// sandbox) live in a database of their own, records.db beside cage.db: they
// come in floods a sandbox controls, and neither their writes nor their
// reads may wait on, or hold up, the sandboxes and API keys. One
// connection writes (batches, from one goroutine of the manager); readers
// have a pool of their own, and in WAL mode a reader never waits for the
// writer. The file is kept within a size by deleting the oldest records
// (auto_vacuum incremental gives the pages back), and the WAL is truncated
// after checkpoints.

// RecordsFileName is the records database's name inside the data directory.
const RecordsFileName = "records.db"

// Records is the open records database. Its methods are safe for
// concurrent use.
type Records struct {
	w, r *sql.DB
	path string
	now  func() time.Time
}

// NetRecord is one stored network record.
type NetRecord struct {
	ID        int64 // increases with every record, never reused
	SandboxID string
	Time      time.Time
	Kind      string // "connect" or "dns"
	Decision  string
	Proto     string
	Dest      string
	Name      string
	QType     string
	Detail    string
}

const recordsSchema = `
CREATE TABLE IF NOT EXISTS records (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	sandbox_id TEXT    NOT NULL,
	time       INTEGER NOT NULL,
	kind       TEXT    NOT NULL,
	decision   TEXT    NOT NULL DEFAULT '',
	proto      TEXT    NOT NULL DEFAULT '',
	dest       TEXT    NOT NULL DEFAULT '',
	name       TEXT    NOT NULL DEFAULT '',
	qtype      TEXT    NOT NULL DEFAULT '',
	detail     TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS records_sandbox ON records (sandbox_id, id);
CREATE INDEX IF NOT EXISTS records_time ON records (time);
CREATE TABLE IF NOT EXISTS record_counts (
	sandbox_id TEXT    NOT NULL PRIMARY KEY,
	kept       INTEGER NOT NULL DEFAULT 0,
	dropped    INTEGER NOT NULL DEFAULT 0,
	updated    INTEGER NOT NULL DEFAULT 0
);`

// OpenRecords opens (creating it if needed, mode 0600) the records
// database in dataDir.
func OpenRecords(dataDir string) (*Records, error) {
	path, err := OpenDBFile(dataDir, RecordsFileName)
	if err != nil {
		return nil, fmt.Errorf("records: %w", err)
	}
	base := dsn(path)
	// auto_vacuum must be set before the first table exists; on an
	// existing file it is a no-op.
	w, err := sql.Open("sqlite", base+"&_pragma=auto_vacuum(INCREMENTAL)&_pragma=journal_size_limit(16777216)")
	if err != nil {
		return nil, fmt.Errorf("records: open %s: %w", path, err)
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	w.SetConnMaxLifetime(0)
	w.SetConnMaxIdleTime(0)
	rs := &Records{w: w, path: path, now: time.Now}
	if _, err := w.ExecContext(context.Background(), recordsSchema); err != nil {
		w.Close()
		return nil, fmt.Errorf("records: open %s: %w", path, err)
	}
	r, err := sql.Open("sqlite", base+"&_pragma=query_only(1)")
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("records: open %s: %w", path, err)
	}
	r.SetMaxOpenConns(4)
	r.SetMaxIdleConns(4)
	rs.r = r
	return rs, nil
}

// Close closes the database.
func (rs *Records) Close() error { return errors.Join(rs.r.Close(), rs.w.Close()) }

// Path is the database file's path.
func (rs *Records) Path() string { return rs.path }

// Add writes records and counts, in one transaction: the records (times
// as given; zero is now) count as kept for their sandboxes, and dropped
// adds to each sandbox's count of records not written.
func (rs *Records) Add(recs []NetRecord, dropped map[string]int64) error {
	if len(recs) == 0 && len(dropped) == 0 {
		return nil
	}
	ctx := context.Background()
	tx, err := rs.w.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("records: add: %w", err)
	}
	defer tx.Rollback()
	ins, err := tx.PrepareContext(ctx, `INSERT INTO records (sandbox_id, time, kind, decision, proto, dest, name, qtype, detail)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`)
	if err != nil {
		return fmt.Errorf("records: add: %w", err)
	}
	defer ins.Close()
	now := rs.now()
	kept := map[string]int64{}
	for _, r := range recs {
		if r.SandboxID == "" || r.Kind == "" {
			return fmt.Errorf("records: add: a record without a sandbox or kind")
		}
		at := r.Time
		if at.IsZero() {
			at = now
		}
		if _, err := ins.ExecContext(ctx, r.SandboxID, nanos(at), r.Kind, r.Decision, r.Proto, r.Dest, r.Name, r.QType, r.Detail); err != nil {
			return fmt.Errorf("records: add: %w", err)
		}
		kept[r.SandboxID]++
	}
	for id := range dropped {
		if _, ok := kept[id]; !ok {
			kept[id] = 0
		}
	}
	for id, n := range kept {
		if _, err := tx.ExecContext(ctx, `INSERT INTO record_counts (sandbox_id, kept, dropped, updated) VALUES (?, ?, ?, ?)
			ON CONFLICT (sandbox_id) DO UPDATE SET kept = kept + excluded.kept, dropped = dropped + excluded.dropped, updated = excluded.updated`,
			id, n, dropped[id], nanos(now)); err != nil {
			return fmt.Errorf("records: add: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("records: add: %w", err)
	}
	return nil
}

// Counts returns how many records of a sandbox were ever kept, and how many
// were dropped (rate, cap or a full queue).
func (rs *Records) Counts(sandboxID string) (kept, dropped int64, err error) {
	err = rs.r.QueryRowContext(context.Background(), "SELECT kept, dropped FROM record_counts WHERE sandbox_id = ?", sandboxID).Scan(&kept, &dropped)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, fmt.Errorf("records: counts: %w", err)
	}
	return kept, dropped, nil
}

// Page returns up to limit records of a sandbox, newest first, older than
// the record before (0: from the newest).
func (rs *Records) Page(sandboxID string, before int64, limit int) ([]NetRecord, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("records: page: limit %d", limit)
	}
	q := `SELECT id, sandbox_id, time, kind, decision, proto, dest, name, qtype, detail FROM records WHERE sandbox_id = ?`
	args := []any{sandboxID}
	if before > 0 {
		q += " AND id < ?"
		args = append(args, before)
	}
	q += " ORDER BY id DESC LIMIT ?"
	args = append(args, limit)
	rows, err := rs.r.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, fmt.Errorf("records: page: %w", err)
	}
	defer rows.Close()
	out := []NetRecord{}
	for rows.Next() {
		var r NetRecord
		var at int64
		if err := rows.Scan(&r.ID, &r.SandboxID, &at, &r.Kind, &r.Decision, &r.Proto, &r.Dest, &r.Name, &r.QType, &r.Detail); err != nil {
			return nil, fmt.Errorf("records: page: %w", err)
		}
		r.Time = fromNanos(at)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("records: page: %w", err)
	}
	return out, nil
}

// Size is the bytes the records take in the database file (its pages less
// the free ones).
func (rs *Records) Size() (int64, error) {
	var pages, free, size int64
	ctx := context.Background()
	for q, v := range map[string]*int64{"PRAGMA page_count": &pages, "PRAGMA freelist_count": &free, "PRAGMA page_size": &size} {
		if err := rs.w.QueryRowContext(ctx, q).Scan(v); err != nil {
			return 0, fmt.Errorf("records: size: %w", err)
		}
	}
	return (pages - free) * size, nil
}

// retainChunk is how many records one deleting transaction removes, so that
// the writer is never held long.
const retainChunk = 5000

// Retain deletes the records older than maxAge (0: no age limit), then the
// oldest until the records take at most maxBytes (0: no size limit), and
// gives the freed pages back to the file system. It returns how many
// records went.
func (rs *Records) Retain(maxAge time.Duration, maxBytes int64) (int64, error) {
	ctx := context.Background()
	var total int64
	del := func(q string, args ...any) (int64, error) {
		res, err := rs.w.ExecContext(ctx, q, args...)
		if err != nil {
			return 0, fmt.Errorf("records: retain: %w", err)
		}
		n, _ := res.RowsAffected()
		total += n
		return n, nil
	}
	if maxAge > 0 {
		cut := nanos(rs.now().Add(-maxAge))
		for {
			n, err := del("DELETE FROM records WHERE id IN (SELECT id FROM records WHERE time < ? ORDER BY id LIMIT ?)", cut, retainChunk)
			if err != nil {
				return total, err
			}
			if n < retainChunk {
				break
			}
		}
		if _, err := del("DELETE FROM record_counts WHERE updated < ? AND sandbox_id NOT IN (SELECT DISTINCT sandbox_id FROM records)", cut); err != nil {
			return total, err
		}
	}
	for maxBytes > 0 {
		size, err := rs.Size()
		if err != nil || size <= maxBytes {
			break
		}
		// The share of the records that is too much, a chunk at most.
		var rows int64
		if err := rs.w.QueryRowContext(ctx, "SELECT count(*) FROM records").Scan(&rows); err != nil || rows == 0 {
			break
		}
		n := min(retainChunk, rows*(size-maxBytes)/size+1)
		if n, err := del("DELETE FROM records WHERE id IN (SELECT id FROM records ORDER BY id LIMIT ?)", n); err != nil || n == 0 {
			break
		}
	}
	if _, err := rs.w.ExecContext(ctx, "PRAGMA incremental_vacuum"); err != nil {
		return total, fmt.Errorf("records: retain: %w", err)
	}
	if _, err := rs.w.ExecContext(ctx, "PRAGMA wal_checkpoint(TRUNCATE)"); err != nil && !strings.Contains(err.Error(), "locked") {
		return total, fmt.Errorf("records: retain: %w", err)
	}
	return total, nil
}

// FileSize is the bytes of the database's files on disk (the file and its
// write-ahead log).
func (rs *Records) FileSize() int64 {
	var n int64
	for _, p := range []string{rs.path, rs.path + "-wal"} {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}
