// Package store is the daemon's state in an embedded SQLite database
// (<dataDir>/cage.db): sandboxes, API keys, teams, snapshots, volumes and
// an old table of events;
// and the sandboxes' network records in a database of their own
// (<dataDir>/records.db, see Records), so that their floods never wait on
// or hold up the rest.
//
// It uses the pure-Go driver modernc.org/sqlite, so cage still builds with
// CGO_ENABLED=0. The database runs in WAL mode with synchronous=NORMAL: a
// committed transaction survives a crash of the process (it is in the WAL
// file), and at worst the last transactions before a power loss are lost,
// never the consistency of the file. All access goes through one connection,
// which serialises writers inside the process; other processes (a CLI run
// next to the daemon) wait up to busy_timeout for the lock.
//
// Maps are stored as JSON text, times as unix nanoseconds (so ordering is
// exact), booleans as 0/1. Errors wrap ErrNotFound, ErrConflict,
// ErrInvalidCursor or ErrAmbiguous where a caller may want to tell them apart.
package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver
)

// Error kinds; wrapped with %w, test them with errors.Is.
var (
	ErrNotFound      = errors.New("not found")
	ErrConflict      = errors.New("already exists")
	ErrInvalidCursor = errors.New("invalid cursor")
	ErrAmbiguous     = errors.New("ambiguous")
	// ErrAdminInTeam: an admin key belongs to no team.
	ErrAdminInTeam = errors.New("an admin key belongs to no team")
)

// FileName is the database's name inside the data directory.
const FileName = "cage.db"

// Store is an open database. Its methods are safe for concurrent use.
type Store struct {
	db   *sql.DB
	path string
	now  func() time.Time // the clock; tests replace it

	stmtMu sync.Mutex
	stmts  map[string]*sql.Stmt // see prepared
}

// prepared returns query prepared once on the store's connection: what every
// create, start and kill runs (sandbox rows, key checks) would otherwise be
// parsed and compiled by SQLite at each call, about half of its cost. Only
// queries whose text is a constant of this package come here, so the cache
// is bounded.
func (s *Store) prepared(query string) (*sql.Stmt, error) {
	s.stmtMu.Lock()
	defer s.stmtMu.Unlock()
	if st, ok := s.stmts[query]; ok {
		return st, nil
	}
	st, err := s.db.PrepareContext(context.Background(), query)
	if err != nil {
		return nil, err
	}
	if s.stmts == nil {
		s.stmts = map[string]*sql.Stmt{}
	}
	s.stmts[query] = st
	return st, nil
}

// migrations are applied in order; migration i brings the schema to version
// i+1 (PRAGMA user_version). Append only: never edit one that has shipped.
var migrations = []string{
	// 1: the initial schema.
	`CREATE TABLE sandboxes (
		id             TEXT    NOT NULL PRIMARY KEY,
		key_id         TEXT    NOT NULL DEFAULT '',
		template_id    TEXT    NOT NULL DEFAULT '',
		wall           TEXT    NOT NULL DEFAULT '',
		state          TEXT    NOT NULL,
		metadata       TEXT    NOT NULL DEFAULT '{}',
		env_vars       TEXT    NOT NULL DEFAULT '{}',
		cpus           REAL    NOT NULL DEFAULT 0,
		memory_mb      INTEGER NOT NULL DEFAULT 0,
		disk_mb        INTEGER NOT NULL DEFAULT 0,
		pids           INTEGER NOT NULL DEFAULT 0,
		access_token   TEXT    NOT NULL DEFAULT '',
		traffic_token  TEXT    NOT NULL DEFAULT '',
		agent_pid      INTEGER NOT NULL DEFAULT 0,
		agent_start    INTEGER NOT NULL DEFAULT 0,
		started_at     INTEGER NOT NULL DEFAULT 0,
		end_at         INTEGER NOT NULL DEFAULT 0,
		allow_internet INTEGER NOT NULL DEFAULT 0,
		auto_pause     INTEGER NOT NULL DEFAULT 0
	);
	CREATE INDEX sandboxes_order ON sandboxes (started_at, id);
	CREATE INDEX sandboxes_key ON sandboxes (key_id, started_at, id);
	CREATE INDEX sandboxes_state ON sandboxes (state);

	CREATE TABLE api_keys (
		id         TEXT    NOT NULL PRIMARY KEY,
		name       TEXT    NOT NULL DEFAULT '',
		prefix     TEXT    NOT NULL,
		hash       BLOB    NOT NULL UNIQUE,
		created_at INTEGER NOT NULL,
		revoked_at INTEGER,
		last_used  INTEGER
	);
	CREATE INDEX api_keys_prefix ON api_keys (prefix);

	CREATE TABLE events (
		id         INTEGER PRIMARY KEY AUTOINCREMENT,
		sandbox_id TEXT    NOT NULL DEFAULT '',
		time       INTEGER NOT NULL,
		kind       TEXT    NOT NULL,
		detail     TEXT    NOT NULL DEFAULT ''
	);
	CREATE INDEX events_sandbox ON events (sandbox_id, id);
	CREATE INDEX events_time ON events (time);`,
	// 2: sandbox networks: the policy (JSON, '' for none), the slot whose
	// interface and rules the sandbox holds, and whether its exposed ports
	// need the traffic token.
	`ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '';
	ALTER TABLE sandboxes ADD COLUMN net_slot INTEGER NOT NULL DEFAULT -1;
	ALTER TABLE sandboxes ADD COLUMN public_traffic INTEGER NOT NULL DEFAULT 1;`,
	// 3: durable state: how a paused sandbox was paused and when, what its
	// lifecycle asks (pause at timeout keeping memory or not, resume on
	// traffic), the timeout it was created with (an auto-resume's), and
	// snapshots.
	`ALTER TABLE sandboxes ADD COLUMN paused_at INTEGER NOT NULL DEFAULT 0;
	ALTER TABLE sandboxes ADD COLUMN pause_kind TEXT NOT NULL DEFAULT '';
	ALTER TABLE sandboxes ADD COLUMN auto_pause_memory INTEGER NOT NULL DEFAULT 1;
	ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
	ALTER TABLE sandboxes ADD COLUMN timeout_s INTEGER NOT NULL DEFAULT 0;
	CREATE TABLE snapshots (
		id          TEXT    NOT NULL PRIMARY KEY,
		key_id      TEXT    NOT NULL DEFAULT '',
		sandbox_id  TEXT    NOT NULL DEFAULT '',
		name        TEXT    NOT NULL DEFAULT '',
		template_id TEXT    NOT NULL DEFAULT '',
		wall        TEXT    NOT NULL DEFAULT '',
		kind        TEXT    NOT NULL DEFAULT 'files',
		size        INTEGER NOT NULL DEFAULT 0,
		created_at  INTEGER NOT NULL,
		spec        TEXT    NOT NULL DEFAULT '{}'
	);
	CREATE INDEX snapshots_key ON snapshots (key_id, created_at, id);
	CREATE UNIQUE INDEX snapshots_name ON snapshots (key_id, name) WHERE name != '';`,
	// 4: volumes (a key's named file systems, each with the bearer token
	// of its content API and its size in bytes), and the volumes a sandbox
	// mounts (JSON: [{id, name, path}]).
	`CREATE TABLE volumes (
		id         TEXT    NOT NULL PRIMARY KEY,
		key_id     TEXT    NOT NULL DEFAULT '',
		name       TEXT    NOT NULL,
		token      TEXT    NOT NULL,
		size       INTEGER NOT NULL DEFAULT 0,
		created_at INTEGER NOT NULL
	);
	CREATE UNIQUE INDEX volumes_name ON volumes (key_id, name);
	ALTER TABLE sandboxes ADD COLUMN volume_mounts TEXT NOT NULL DEFAULT '[]';`,
	// 5: teams (teams.go): a team owns what its keys make, and has quotas
	// and rate limits (JSON); a key belongs to a team or to none (then it
	// is its own owner, as before), and may be an admin key.
	`CREATE TABLE teams (
		id         TEXT    NOT NULL PRIMARY KEY,
		name       TEXT    NOT NULL UNIQUE,
		limits     TEXT    NOT NULL DEFAULT '{}',
		created_at INTEGER NOT NULL
	);
	ALTER TABLE api_keys ADD COLUMN team_id TEXT NOT NULL DEFAULT '';
	ALTER TABLE api_keys ADD COLUMN admin INTEGER NOT NULL DEFAULT 0;
	CREATE INDEX api_keys_team ON api_keys (team_id);`,
	// 6: the ports the proxy reaches over TLS (E2B's network.httpsPorts;
	// JSON: [8443]).
	`ALTER TABLE sandboxes ADD COLUMN https_ports TEXT NOT NULL DEFAULT '[]';`,
}

// SchemaVersion is the schema version this binary writes.
var SchemaVersion = len(migrations)

// Open opens (creating it if needed) the database in dataDir and brings its
// schema up to date. dataDir is created 0700 if missing and the database
// file 0600 (SQLite gives its -wal and -shm files the same mode).
func Open(dataDir string) (*Store, error) {
	if dataDir == "" {
		return nil, errors.New("store: empty data directory")
	}
	// Create the file ourselves so it gets 0600 whatever SQLite's default.
	path, err := OpenDBFile(dataDir, FileName)
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}

	db, err := sql.Open("sqlite", dsn(path))
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	// One connection: SQLite has a single writer anyway, and this makes every
	// method trivially race-free. The connection is never recycled.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)

	s := &Store{db: db, path: path, now: time.Now}
	if err := s.init(); err != nil {
		db.Close()
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	return s, nil
}

// dsn builds the driver's connection string. The path goes in a "file:" URI,
// percent-encoded, so a data directory containing '?', '#' or '%' works.
// _txlock=immediate takes the write lock at BEGIN, so a transaction never has
// to upgrade a read lock (which fails with SQLITE_BUSY at once, without
// waiting, when another process is writing).
func dsn(path string) string {
	u := url.URL{Path: path}
	q := []string{
		"_pragma=busy_timeout(5000)",
		"_pragma=journal_mode(WAL)",
		"_pragma=synchronous(NORMAL)",
		"_pragma=foreign_keys(ON)",
		"_txlock=immediate",
	}
	return "file:" + u.EscapedPath() + "?" + strings.Join(q, "&")
}

func (s *Store) init() error {
	ctx := context.Background()
	var mode string
	if err := s.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return err
	}
	if !strings.EqualFold(mode, "wal") {
		return fmt.Errorf("journal_mode is %q, want wal (does the filesystem support it?)", mode)
	}
	return s.migrate(ctx)
}

// migrate applies the missing migrations in one transaction. It re-reads the
// version inside the (immediate, so exclusive-for-writes) transaction, so two
// processes opening the same database at once do not both migrate.
func (s *Store) migrate(ctx context.Context) error {
	tx, err := s.db.BeginTx(ctx, nil)
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
	if v == len(migrations) {
		return nil
	}
	for i := v; i < len(migrations); i++ {
		if _, err := tx.ExecContext(ctx, migrations[i]); err != nil {
			return fmt.Errorf("migration %d: %w", i+1, err)
		}
	}
	// PRAGMA takes no bound parameters; the value is an int we control.
	if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", len(migrations))); err != nil {
		return err
	}
	return tx.Commit()
}

// Path is the database file's path.
func (s *Store) Path() string { return s.path }

// Close closes the database. SQLite checkpoints the WAL into the main file
// when its last connection closes.
func (s *Store) Close() error {
	s.stmtMu.Lock()
	for _, st := range s.stmts {
		st.Close()
	}
	s.stmts = nil
	s.stmtMu.Unlock()
	return s.db.Close()
}

// nanos and fromNanos map times to INTEGER columns; the zero time is 0.
func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}

func nullNanos(t *time.Time) sql.NullInt64 {
	if t == nil {
		return sql.NullInt64{}
	}
	return sql.NullInt64{Int64: nanos(*t), Valid: true}
}

func fromNullNanos(n sql.NullInt64) *time.Time {
	if !n.Valid {
		return nil
	}
	t := fromNanos(n.Int64)
	return &t
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}
