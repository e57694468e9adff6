package audit

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver

	"github.com/cagehq/cage/internal/store"
)

// FileName is the trail's database inside the data directory.
const FileName = "audit.db"

// DB is the open trail database: one connection writes (appends and
// retention, serialised), a pool of its own reads, and in WAL mode a reader
// never waits for the writer. Other processes (`cage keys`) append through
// their own DB; every append reads the head inside its transaction, which
// SQLite makes exclusive, so two writers never fork the chain.
type DB struct {
	w, r *sql.DB
	path string
	now  func() time.Time
}

// migrations bring the schema to version i+1 (PRAGMA user_version). Append
// only.
var migrations = []string{
	// 1: the chain, and per sandbox how many entries were kept and not.
	`CREATE TABLE entries (
		seq        INTEGER PRIMARY KEY,
		time       INTEGER NOT NULL,
		kind       TEXT    NOT NULL,
		source     TEXT    NOT NULL,
		key_id     TEXT    NOT NULL DEFAULT '',
		team_id    TEXT    NOT NULL DEFAULT '',
		sandbox_id TEXT    NOT NULL DEFAULT '',
		route      TEXT    NOT NULL DEFAULT '',
		status     INTEGER NOT NULL DEFAULT 0,
		client     TEXT    NOT NULL DEFAULT '',
		detail     TEXT    NOT NULL DEFAULT '{}',
		prev       TEXT    NOT NULL,
		hash       TEXT    NOT NULL
	);
	CREATE INDEX entries_sandbox ON entries (sandbox_id, seq);
	CREATE INDEX entries_key ON entries (key_id, seq);
	CREATE INDEX entries_time ON entries (time);
	CREATE TABLE counts (
		sandbox_id TEXT    NOT NULL PRIMARY KEY,
		key_id     TEXT    NOT NULL DEFAULT '',
		kept       INTEGER NOT NULL DEFAULT 0,
		dropped    INTEGER NOT NULL DEFAULT 0,
		updated    INTEGER NOT NULL DEFAULT 0
	);`,
	// 2: a team's entries (GET /audit of a team's key, cage audit --team).
	`CREATE INDEX entries_team ON entries (team_id, seq);`,
}

// Open opens (creating it 0600 if needed) the trail database in dataDir.
func Open(dataDir string) (*DB, error) {
	path, err := store.OpenDBFile(dataDir, FileName)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	u := url.URL{Path: path}
	base := "file:" + u.EscapedPath() + "?" + strings.Join([]string{"_pragma=busy_timeout(10000)",
		"_pragma=journal_mode(WAL)", "_pragma=synchronous(NORMAL)", "_txlock=immediate"}, "&")
	// auto_vacuum must be set before the first table exists.
	w, err := sql.Open("sqlite", base+"&_pragma=auto_vacuum(INCREMENTAL)&_pragma=journal_size_limit(16777216)")
	if err != nil {
		return nil, fmt.Errorf("audit: open %s: %w", path, err)
	}
	w.SetMaxOpenConns(1)
	w.SetMaxIdleConns(1)
	w.SetConnMaxLifetime(0)
	w.SetConnMaxIdleTime(0)
	db := &DB{w: w, path: path, now: time.Now}
	if err := db.migrate(); err != nil {
		w.Close()
		return nil, fmt.Errorf("audit: open %s: %w", path, err)
	}
	if db.r, err = sql.Open("sqlite", base+"&_pragma=query_only(1)"); err != nil {
		w.Close()
		return nil, fmt.Errorf("audit: open %s: %w", path, err)
	}
	db.r.SetMaxOpenConns(4)
	db.r.SetMaxIdleConns(4)
	return db, nil
}

func (db *DB) migrate() error {
	ctx := context.Background()
	tx, err := db.w.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var v int
	if err := tx.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
		return err
	}
	if v > len(migrations) {
		return fmt.Errorf("schema version %d is newer than this cage supports (%d); upgrade cage", v, len(migrations))
	}
	for i := v; i < len(migrations); i++ {
		if _, err := tx.ExecContext(ctx, migrations[i]); err != nil {
			return fmt.Errorf("migration %d: %w", i+1, err)
		}
	}
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", len(migrations))); err != nil {
		return err
	}
	return tx.Commit()
}

// Close closes the database.
func (db *DB) Close() error { return errors.Join(db.r.Close(), db.w.Close()) }

// Path is the database file's path.
func (db *DB) Path() string { return db.path }

// row is an entry to append: the event's fields, its detail marshalled.
type row struct {
	ev     Event
	detail string
}

// newRow marshals an event's detail and fills its defaults.
func newRow(ev Event, now time.Time) row {
	if ev.Time.IsZero() {
		ev.Time = now
	}
	if ev.Source == "" {
		ev.Source = SourceHost
	}
	if ev.TeamID == "" {
		ev.KeyID, ev.TeamID = SplitOwner(ev.KeyID)
	}
	d := "{}"
	if len(ev.Detail) > 0 {
		if b, err := json.Marshal(ev.Detail); err == nil {
			d = string(b)
		} else {
			d = fmt.Sprintf(`{"unencodable":%q}`, err.Error())
		}
	}
	return row{ev: ev, detail: d}
}

// head is the last entry's seq and hash, read inside tx; an empty chain's
// head is (0, Genesis).
func head(ctx context.Context, tx *sql.Tx) (int64, string, error) {
	var seq int64
	var h string
	err := tx.QueryRowContext(ctx, "SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1").Scan(&seq, &h)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, Genesis, nil
	}
	return seq, h, err
}

// appendTx chains rows after the head, inside tx.
func appendTx(ctx context.Context, tx *sql.Tx, rows []row) error {
	if len(rows) == 0 {
		return nil
	}
	seq, prev, err := head(ctx, tx)
	if err != nil {
		return err
	}
	ins, err := tx.PrepareContext(ctx, `INSERT INTO entries (seq, time, kind, source, key_id, team_id, sandbox_id, route, status, client, detail, prev, hash)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`)
	if err != nil {
		return err
	}
	defer ins.Close()
	for _, r := range rows {
		seq++
		e := Entry{Seq: seq, Time: time.Unix(0, r.ev.Time.UnixNano()), Kind: r.ev.Kind, Source: r.ev.Source, KeyID: r.ev.KeyID,
			TeamID: r.ev.TeamID, SandboxID: r.ev.SandboxID, Route: r.ev.Route, Status: r.ev.Status, Client: r.ev.Client, Detail: r.detail, Prev: prev}
		e.Hash = e.ComputeHash()
		if _, err := ins.ExecContext(ctx, e.Seq, e.Time.UnixNano(), e.Kind, e.Source, e.KeyID, e.TeamID, e.SandboxID,
			e.Route, e.Status, e.Client, e.Detail, e.Prev, e.Hash); err != nil {
			return err
		}
		prev = e.Hash
	}
	return nil
}

// tally is one sandbox's counts to add in a batch.
type tally struct {
	key           string
	kept, dropped int64
}

// write appends rows and adds the sandboxes' counts, in one transaction.
func (db *DB) write(rows []row, counts map[string]*tally) error {
	if len(rows) == 0 && len(counts) == 0 {
		return nil
	}
	ctx := context.Background()
	tx, err := db.w.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("audit: write: %w", err)
	}
	defer tx.Rollback()
	if err := appendTx(ctx, tx, rows); err != nil {
		return fmt.Errorf("audit: write: %w", err)
	}
	now := db.now().UnixNano()
	for id, c := range counts {
		if _, err := tx.ExecContext(ctx, `INSERT INTO counts (sandbox_id, key_id, kept, dropped, updated) VALUES (?, ?, ?, ?, ?)
			ON CONFLICT (sandbox_id) DO UPDATE SET kept = kept + excluded.kept, dropped = dropped + excluded.dropped,
			key_id = CASE WHEN excluded.key_id != '' THEN excluded.key_id ELSE key_id END, updated = excluded.updated`,
			id, c.key, c.kept, c.dropped, now); err != nil {
			return fmt.Errorf("audit: write: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("audit: write: %w", err)
	}
	return nil
}

// Append appends events at once, synchronously: for a process that is not
// the daemon (`cage keys`). Times zero are now.
func (db *DB) Append(evs ...Event) error {
	rows := make([]row, 0, len(evs))
	for _, ev := range evs {
		if ev.Kind == "" {
			return errors.New("audit: append: an event without a kind")
		}
		rows = append(rows, newRow(ev, db.now()))
	}
	return db.write(rows, nil)
}

// Counts returns how many entries of a sandbox were kept and how many were
// not (over its cap, or the queue full), and the key they belong to.
func (db *DB) Counts(sandboxID string) (key string, kept, dropped int64, err error) {
	err = db.r.QueryRowContext(context.Background(), "SELECT key_id, kept, dropped FROM counts WHERE sandbox_id = ?", sandboxID).
		Scan(&key, &kept, &dropped)
	if errors.Is(err, sql.ErrNoRows) {
		return "", 0, 0, nil
	}
	if err != nil {
		return "", 0, 0, fmt.Errorf("audit: counts: %w", err)
	}
	return key, kept, dropped, nil
}

// Head is the last entry's seq and hash: what to export to anchor the
// chain outside the host.
func (db *DB) Head() (int64, string, error) {
	var seq int64
	var h string
	err := db.r.QueryRowContext(context.Background(), "SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1").Scan(&seq, &h)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, Genesis, nil
	}
	if err != nil {
		return 0, "", fmt.Errorf("audit: head: %w", err)
	}
	return seq, h, nil
}

// Size is the bytes the trail takes in the database file (its pages less
// the free ones).
func (db *DB) Size() (int64, error) {
	var pages, free, size int64
	ctx := context.Background()
	for _, q := range []struct {
		sql string
		v   *int64
	}{{"PRAGMA page_count", &pages}, {"PRAGMA freelist_count", &free}, {"PRAGMA page_size", &size}} {
		if err := db.w.QueryRowContext(ctx, q.sql).Scan(q.v); err != nil {
			return 0, fmt.Errorf("audit: size: %w", err)
		}
	}
	return (pages - free) * size, nil
}

// FileSize is the bytes of the database's files on disk (the file and its
// write-ahead log).
func (db *DB) FileSize() int64 {
	var n int64
	for _, p := range []string{db.path, db.path + "-wal"} {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}
