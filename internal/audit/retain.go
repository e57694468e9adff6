package audit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// retainChunk is how many entries one pruning transaction removes at most,
// so that the writer is never held long; each chunk's anchor is its own.
const retainChunk = 5000

// Retain removes the entries older than maxAge (0: no age limit), then the
// oldest until the trail takes at most maxBytes (0: no size limit). It only
// ever removes the oldest entries, never the newest, and in the same
// transaction appends an anchor entry (KindAnchor) that names the last
// entry removed and its hash, so that the chain still verifies. It returns
// how many entries went.
func (db *DB) Retain(maxAge time.Duration, maxBytes int64) (int64, error) {
	var total int64
	for {
		k, reason, err := db.pruneTarget(maxAge, maxBytes)
		if err != nil || k == 0 {
			return total, err
		}
		n, err := db.pruneThrough(k, reason)
		total += n
		if err != nil || n == 0 {
			return total, err
		}
	}
}

// pruneTarget is the last seq the next chunk removes (0: nothing to
// remove) and why.
func (db *DB) pruneTarget(maxAge time.Duration, maxBytes int64) (int64, string, error) {
	ctx := context.Background()
	var first, last sql.NullInt64
	if err := db.w.QueryRowContext(ctx, "SELECT min(seq), max(seq) FROM entries").Scan(&first, &last); err != nil {
		return 0, "", fmt.Errorf("audit: retain: %w", err)
	}
	if !first.Valid || first.Int64 >= last.Int64 {
		return 0, "", nil // never the head
	}
	lo, hi := first.Int64, min(first.Int64+retainChunk-1, last.Int64-1)
	if maxAge > 0 {
		cut := db.now().Add(-maxAge).UnixNano()
		// The first entry of the chunk young enough to stay.
		var young sql.NullInt64
		err := db.w.QueryRowContext(ctx, "SELECT min(seq) FROM entries WHERE seq BETWEEN ? AND ? AND time >= ?", lo, hi, cut).Scan(&young)
		if err != nil {
			return 0, "", fmt.Errorf("audit: retain: %w", err)
		}
		if !young.Valid {
			return hi, "age", nil
		}
		if young.Int64 > lo {
			return young.Int64 - 1, "age", nil
		}
	}
	if maxBytes > 0 {
		size, err := db.Size()
		if err != nil || size <= maxBytes {
			return 0, "", err
		}
		rows := last.Int64 - first.Int64 + 1
		n := min(int64(retainChunk), rows*(size-maxBytes)/size+1)
		return min(lo+n-1, hi), "size", nil
	}
	return 0, "", nil
}

// pruneThrough removes the entries up to seq k and anchors the chain, in
// one transaction.
func (db *DB) pruneThrough(k int64, reason string) (int64, error) {
	ctx := context.Background()
	tx, err := db.w.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("audit: retain: %w", err)
	}
	defer tx.Rollback()
	var h string
	if err := tx.QueryRowContext(ctx, "SELECT hash FROM entries WHERE seq = ?", k).Scan(&h); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return 0, fmt.Errorf("audit: retain: entry %d is missing: the chain is broken there (cage audit verify)", k)
		}
		return 0, fmt.Errorf("audit: retain: %w", err)
	}
	res, err := tx.ExecContext(ctx, "DELETE FROM entries WHERE seq <= ?", k)
	if err != nil {
		return 0, fmt.Errorf("audit: retain: %w", err)
	}
	n, _ := res.RowsAffected()
	anchor := newRow(Event{Kind: KindAnchor, Detail: map[string]any{"pruned_through": k, "pruned_hash": h,
		"removed": n, "reason": reason}}, db.now())
	if err := appendTx(ctx, tx, []row{anchor}); err != nil {
		return 0, fmt.Errorf("audit: retain: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("audit: retain: %w", err)
	}
	return n, nil
}

// compact gives freed pages back and truncates the write-ahead log.
func (db *DB) compact() error {
	ctx := context.Background()
	if _, err := db.w.ExecContext(ctx, "PRAGMA incremental_vacuum"); err != nil {
		return fmt.Errorf("audit: compact: %w", err)
	}
	if _, err := db.w.ExecContext(ctx, "PRAGMA wal_checkpoint(TRUNCATE)"); err != nil && !strings.Contains(err.Error(), "locked") {
		return fmt.Errorf("audit: compact: %w", err)
	}
	return nil
}
