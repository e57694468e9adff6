package audit

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// Filter selects entries. Entries come oldest first (by seq).
type Filter struct {
	// All reads every key's entries (the operator); otherwise only
	// TeamID's (a team's key) or else KeyID's (a key without a team).
	// With All, KeyID and TeamID filter when set.
	All       bool
	KeyID     string
	TeamID    string
	SandboxID string
	// Kinds are kinds ("process.start") or families ("process"); any
	// matches.
	Kinds []string
	Since time.Time // entries at or after (zero: from the first)
	Until time.Time // entries before (zero: to the last)
	After int64     // entries after this seq (a page's cursor)
	Limit int       // at most (0: no limit)
}

const columns = "seq, time, kind, source, key_id, team_id, sandbox_id, route, status, client, detail, prev, hash"

func scanEntry(rows *sql.Rows) (Entry, error) {
	var e Entry
	var at int64
	err := rows.Scan(&e.Seq, &at, &e.Kind, &e.Source, &e.KeyID, &e.TeamID, &e.SandboxID, &e.Route, &e.Status,
		&e.Client, &e.Detail, &e.Prev, &e.Hash)
	e.Time = time.Unix(0, at).UTC()
	return e, err
}

// Query returns the entries f selects, oldest first.
func (db *DB) Query(f Filter) ([]Entry, error) {
	q, args, err := f.query(columns)
	if err != nil {
		return nil, err
	}
	return db.entries(q, args)
}

// entries runs q, a selection of columns, and scans what it returns.
func (db *DB) entries(q string, args []any) ([]Entry, error) {
	rows, err := db.r.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, fmt.Errorf("audit: query: %w", err)
	}
	defer rows.Close()
	out := []Entry{}
	for rows.Next() {
		e, err := scanEntry(rows)
		if err != nil {
			return nil, fmt.Errorf("audit: query: %w", err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("audit: query: %w", err)
	}
	return out, nil
}

// Seqs returns the seqs of the entries f selects, in order: what a page
// of them is, without their details (a page's answer is then read a few
// entries at a time).
func (db *DB) Seqs(f Filter) ([]int64, error) {
	q, args, err := f.query("seq")
	if err != nil {
		return nil, err
	}
	rows, err := db.r.QueryContext(context.Background(), q, args...)
	if err != nil {
		return nil, fmt.Errorf("audit: query: %w", err)
	}
	defer rows.Close()
	out := []int64{}
	for rows.Next() {
		var seq int64
		if err := rows.Scan(&seq); err != nil {
			return nil, fmt.Errorf("audit: query: %w", err)
		}
		out = append(out, seq)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("audit: query: %w", err)
	}
	return out, nil
}

// Entries returns the entries of the given seqs that are still kept, in
// order of seq (a page Seqs selected, a few at a time).
func (db *DB) Entries(seqs []int64) ([]Entry, error) {
	if len(seqs) == 0 {
		return []Entry{}, nil
	}
	args := make([]any, len(seqs))
	for i, s := range seqs {
		args[i] = s
	}
	q := "SELECT " + columns + " FROM entries WHERE seq IN (" + strings.TrimSuffix(strings.Repeat("?, ", len(seqs)), ", ") + ") ORDER BY seq"
	return db.entries(q, args)
}

// query is the statement and arguments that select cols of f's entries.
func (f Filter) query(cols string) (string, []any, error) {
	var where []string
	var args []any
	if f.TeamID != "" {
		where, args = append(where, "team_id = ?"), append(args, f.TeamID)
	}
	if f.KeyID != "" || (!f.All && f.TeamID == "") {
		where, args = append(where, "key_id = ?"), append(args, f.KeyID)
	}
	if f.SandboxID != "" {
		where, args = append(where, "sandbox_id = ?"), append(args, f.SandboxID)
	}
	if len(f.Kinds) > 0 {
		var or []string
		for _, k := range f.Kinds {
			if !ValidKind(k) {
				return "", nil, fmt.Errorf("audit: query: kind %q", k)
			}
			if strings.Contains(k, ".") {
				or, args = append(or, "kind = ?"), append(args, k)
			} else {
				or, args = append(or, "kind >= ? AND kind < ?"), append(args, k+".", k+"/") // '/' follows '.'
			}
		}
		where = append(where, "("+strings.Join(or, " OR ")+")")
	}
	if !f.Since.IsZero() {
		where, args = append(where, "time >= ?"), append(args, f.Since.UnixNano())
	}
	if !f.Until.IsZero() {
		where, args = append(where, "time < ?"), append(args, f.Until.UnixNano())
	}
	if f.After > 0 {
		where, args = append(where, "seq > ?"), append(args, f.After)
	}
	q := "SELECT " + cols + " FROM entries"
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	q += " ORDER BY seq"
	if f.Limit > 0 {
		q, args = q+" LIMIT ?", append(args, f.Limit)
	}
	return q, args, nil
}

// each calls fn on every entry from seq from on, in order, a page at a
// time, until fn returns false.
func (db *DB) each(from int64, fn func(Entry) bool) error {
	const page = 5000
	for {
		rows, err := db.r.QueryContext(context.Background(), "SELECT "+columns+" FROM entries WHERE seq >= ? ORDER BY seq LIMIT ?", from, page)
		if err != nil {
			return fmt.Errorf("audit: read: %w", err)
		}
		n := 0
		stop := false
		for rows.Next() {
			e, err := scanEntry(rows)
			if err != nil {
				rows.Close()
				return fmt.Errorf("audit: read: %w", err)
			}
			n++
			from = e.Seq + 1
			if !fn(e) {
				stop = true
				break
			}
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return fmt.Errorf("audit: read: %w", err)
		}
		if stop || n < page {
			return nil
		}
	}
}
