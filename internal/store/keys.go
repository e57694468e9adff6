package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// API keys look like E2B's: KeyPrefix followed by 40 lowercase hex
// characters (160 random bits). Only their SHA-256 is stored: with that much
// entropy a fast hash is enough, no slow KDF is needed.
const (
	KeyPrefix     = "e2b_"
	keyHexLen     = 40
	displayLen    = 8 // APIKey.Prefix length
	lastUsedEvery = time.Minute
)

// APIKey describes a key; the key itself is shown once, by CreateKey.
type APIKey struct {
	ID        string // short public id, "key_" + 12 hex
	Name      string
	Prefix    string // first 8 characters of the key after "e2b_", for display
	CreatedAt time.Time
	RevokedAt *time.Time
	LastUsed  *time.Time
	// TeamID is the team the key belongs to ("" none: the key is its own
	// owner). It is fixed when the key is made.
	TeamID string
	// Admin keys also manage teams and keys through the API.
	Admin bool
}

// Owner is who owns what the key makes (sandboxes, snapshots, volumes)
// and whose audit entries it reads: its team, or the key itself when it
// has none (a key without a team is a team of its own).
func (k *APIKey) Owner() string {
	if k.TeamID != "" {
		return k.TeamID
	}
	return k.ID
}

const keyCols = "id, name, prefix, created_at, revoked_at, last_used, team_id, admin"

func scanKey(r scanner, extra ...any) (*APIKey, error) {
	var (
		k                 APIKey
		created           int64
		revoked, lastUsed sql.NullInt64
	)
	dest := append([]any{&k.ID, &k.Name, &k.Prefix, &created, &revoked, &lastUsed, &k.TeamID, &k.Admin}, extra...)
	if err := r.Scan(dest...); err != nil {
		return nil, err
	}
	k.CreatedAt = fromNanos(created)
	k.RevokedAt = fromNullNanos(revoked)
	k.LastUsed = fromNullNanos(lastUsed)
	return &k, nil
}

func hashKey(plaintext string) []byte {
	h := sha256.Sum256([]byte(plaintext))
	return h[:]
}

// wellFormed reports whether s is "e2b_" + 40 lowercase hex characters.
func wellFormed(s string) bool {
	body, ok := strings.CutPrefix(s, KeyPrefix)
	if !ok || len(body) != keyHexLen {
		return false
	}
	for i := 0; i < len(body); i++ {
		c := body[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// CreateKey makes a new API key named name and returns it in plaintext; this
// is the only time the plaintext exists, the database keeps its hash.
func (s *Store) CreateKey(name string) (plaintext string, key *APIKey, err error) {
	return s.CreateKeyWith(KeyOptions{Name: name})
}

// KeyOptions describe a key to make.
type KeyOptions struct {
	Name   string
	TeamID string // a team's id ("" none); ErrNotFound when no such team
	Admin  bool
}

// CreateKeyWith makes a new API key as CreateKey does, in a team or as an
// admin key.
func (s *Store) CreateKeyWith(o KeyOptions) (plaintext string, key *APIKey, err error) {
	if o.Admin && o.TeamID != "" {
		// An admin key is no tenant of any team: in one, it was a
		// tenant of it, and what it did to the other teams and keys
		// (their names, quotas, keys) was in that team's audit trail,
		// which every key of the team reads (found by review,
		// 2026-12-04).
		return "", nil, fmt.Errorf("store: create key: %w", ErrAdminInTeam)
	}
	name := o.Name
	for attempt := 0; attempt < 5; attempt++ {
		body, err := randomHex(keyHexLen / 2)
		if err != nil {
			return "", nil, fmt.Errorf("store: create key: %w", err)
		}
		idHex, err := randomHex(6)
		if err != nil {
			return "", nil, fmt.Errorf("store: create key: %w", err)
		}
		plaintext = KeyPrefix + body
		k := &APIKey{
			ID:        "key_" + idHex,
			Name:      name,
			Prefix:    body[:displayLen],
			CreatedAt: fromNanos(nanos(s.now())),
			TeamID:    o.TeamID,
			Admin:     o.Admin,
		}
		// An id or hash collision (48 resp. 160 random bits) inserts
		// nothing; try again with fresh randomness. A team that does not
		// exist inserts nothing either (told apart below).
		res, err := s.db.ExecContext(context.Background(),
			`INSERT INTO api_keys (id, name, prefix, hash, created_at, team_id, admin)
			SELECT ?, ?, ?, ?, ?, ?, ? WHERE ? = '' OR EXISTS (SELECT 1 FROM teams WHERE id = ?)
			ON CONFLICT DO NOTHING`,
			k.ID, k.Name, k.Prefix, hashKey(plaintext), nanos(k.CreatedAt), k.TeamID, boolInt(k.Admin), k.TeamID, k.TeamID)
		if err != nil {
			return "", nil, fmt.Errorf("store: create key: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return "", nil, fmt.Errorf("store: create key: %w", err)
		} else if n == 1 {
			return plaintext, k, nil
		}
		if o.TeamID != "" {
			if _, err := s.GetTeam(o.TeamID); err != nil {
				return "", nil, fmt.Errorf("store: create key: %w", err)
			}
		}
	}
	return "", nil, fmt.Errorf("store: create key: %w", ErrConflict)
}

// ListKeys returns every key, revoked ones included, oldest first.
func (s *Store) ListKeys() ([]*APIKey, error) {
	rows, err := s.db.QueryContext(context.Background(),
		"SELECT "+keyCols+" FROM api_keys ORDER BY created_at, id")
	if err != nil {
		return nil, fmt.Errorf("store: list keys: %w", err)
	}
	defer rows.Close()
	var keys []*APIKey
	for rows.Next() {
		k, err := scanKey(rows)
		if err != nil {
			return nil, fmt.Errorf("store: list keys: %w", err)
		}
		keys = append(keys, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: list keys: %w", err)
	}
	return keys, nil
}

// RevokeKey revokes the key whose ID is idOrPrefix, or else whose display
// prefix is idOrPrefix (with or without "e2b_" in front). It returns the key
// as revoked. Revoking a revoked key is not an error and keeps the first
// revocation time. ErrNotFound if nothing matches, ErrAmbiguous if a prefix
// matches several keys.
func (s *Store) RevokeKey(idOrPrefix string) (*APIKey, error) {
	if idOrPrefix == "" {
		return nil, fmt.Errorf("store: key %q: %w", idOrPrefix, ErrNotFound)
	}
	ctx := context.Background()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("store: revoke key: %w", err)
	}
	defer tx.Rollback()
	prefix := strings.TrimPrefix(idOrPrefix, KeyPrefix)
	rows, err := tx.QueryContext(ctx,
		"SELECT "+keyCols+" FROM api_keys WHERE id = ? OR prefix = ? ORDER BY id = ? DESC, created_at",
		idOrPrefix, prefix, idOrPrefix)
	if err != nil {
		return nil, fmt.Errorf("store: revoke key: %w", err)
	}
	var matches []*APIKey
	for rows.Next() {
		k, err := scanKey(rows)
		if err != nil {
			rows.Close()
			return nil, fmt.Errorf("store: revoke key: %w", err)
		}
		matches = append(matches, k)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: revoke key: %w", err)
	}
	var k *APIKey
	switch {
	case len(matches) == 0:
		return nil, fmt.Errorf("store: key %q: %w", idOrPrefix, ErrNotFound)
	case matches[0].ID == idOrPrefix: // an exact id wins over prefixes
		k = matches[0]
	case len(matches) > 1:
		return nil, fmt.Errorf("store: key prefix %q matches %d keys, use the id: %w", idOrPrefix, len(matches), ErrAmbiguous)
	default:
		k = matches[0]
	}
	if k.RevokedAt != nil {
		return k, nil
	}
	now := fromNanos(nanos(s.now()))
	if _, err := tx.ExecContext(ctx, "UPDATE api_keys SET revoked_at = ? WHERE id = ?", nanos(now), k.ID); err != nil {
		return nil, fmt.Errorf("store: revoke key %s: %w", k.ID, err)
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("store: revoke key %s: %w", k.ID, err)
	}
	k.RevokedAt = &now
	return k, nil
}

// GetKey returns the key with the given id, revoked or not; ErrNotFound
// when there is none.
func (s *Store) GetKey(id string) (*APIKey, error) {
	k, err := scanKey(s.db.QueryRowContext(context.Background(), "SELECT "+keyCols+" FROM api_keys WHERE id = ?", id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("store: key %q: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get key %q: %w", id, err)
	}
	return k, nil
}

// verifyKeySQL finds the keys sharing a display prefix.
var verifyKeySQL = "SELECT " + keyCols + ", hash FROM api_keys WHERE prefix = ?"

// VerifyKey returns the live key whose plaintext is given. Unknown, malformed
// and revoked keys all give ErrNotFound. It records the use in LastUsed, at
// most once a minute per key so that authenticating is mostly a read.
func (s *Store) VerifyKey(plaintext string) (*APIKey, error) {
	if !wellFormed(plaintext) {
		return nil, fmt.Errorf("store: verify key: %w", ErrNotFound)
	}
	ctx := context.Background()
	want := hashKey(plaintext)
	// Look up by the display prefix (not secret) and compare the hashes in
	// constant time; a 32-bit prefix may be shared, so check every match.
	st, err := s.prepared(verifyKeySQL)
	if err != nil {
		return nil, fmt.Errorf("store: verify key: %w", err)
	}
	rows, err := st.QueryContext(ctx, plaintext[len(KeyPrefix):len(KeyPrefix)+displayLen])
	if err != nil {
		return nil, fmt.Errorf("store: verify key: %w", err)
	}
	var found *APIKey
	for rows.Next() {
		var hash []byte
		k, err := scanKey(rows, &hash)
		if err != nil {
			rows.Close()
			return nil, fmt.Errorf("store: verify key: %w", err)
		}
		if subtle.ConstantTimeCompare(hash, want) == 1 {
			found = k
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: verify key: %w", err)
	}
	if found == nil || found.RevokedAt != nil {
		return nil, fmt.Errorf("store: verify key: %w", ErrNotFound)
	}
	now := fromNanos(nanos(s.now()))
	if found.LastUsed == nil || now.Sub(*found.LastUsed) >= lastUsedEvery {
		// Best effort: failing to record the use must not fail the request.
		// The WHERE keeps concurrent verifications from moving it backwards.
		res, err := s.db.ExecContext(ctx,
			"UPDATE api_keys SET last_used = ? WHERE id = ? AND (last_used IS NULL OR last_used <= ?)",
			nanos(now), found.ID, nanos(now.Add(-lastUsedEvery)))
		if err == nil {
			if n, _ := res.RowsAffected(); n == 1 {
				found.LastUsed = &now
			}
		}
	}
	return found, nil
}

// RevokedOwners lists the revoked keys without a team that still own a
// sandbox, a snapshot or a volume: nobody can reach those any more (a
// team's keys own nothing themselves; the team does).
func (s *Store) RevokedOwners() ([]string, error) {
	rows, err := s.db.QueryContext(context.Background(), `SELECT id FROM api_keys k
		WHERE revoked_at IS NOT NULL AND team_id = '' AND (
			EXISTS (SELECT 1 FROM sandboxes WHERE key_id = k.id) OR
			EXISTS (SELECT 1 FROM snapshots WHERE key_id = k.id) OR
			EXISTS (SELECT 1 FROM volumes WHERE key_id = k.id))`)
	if err != nil {
		return nil, fmt.Errorf("store: revoked owners: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("store: revoked owners: %w", err)
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("store: revoked owners: %w", err)
	}
	return out, nil
}
