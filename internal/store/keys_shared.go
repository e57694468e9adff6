package store

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"time"
)

// SharedKey is an API key as a cluster shares it between its nodes (the
// Secret cage-api-keys, internal/cluster/keys.go): everything but the
// plaintext, which exists only where the key was made.
type SharedKey struct {
	ID      string `json:"id"`
	Name    string `json:"name,omitempty"`
	Prefix  string `json:"prefix"`
	Hash    string `json:"hash"`    // hex of the plaintext's SHA-256
	Created int64  `json:"created"` // Unix nanoseconds
	Revoked int64  `json:"revoked,omitempty"`
	Admin   bool   `json:"admin,omitempty"`
}

// NewSharedKey makes a key (no team: teams are each node's) and returns
// its plaintext, shown once, and its shared form; it stores nothing.
func NewSharedKey(name string, admin bool, now time.Time) (plaintext string, k SharedKey, err error) {
	body, err := randomHex(keyHexLen / 2)
	if err != nil {
		return "", k, fmt.Errorf("store: new key: %w", err)
	}
	idHex, err := randomHex(6)
	if err != nil {
		return "", k, fmt.Errorf("store: new key: %w", err)
	}
	plaintext = KeyPrefix + body
	k = SharedKey{ID: "key_" + idHex, Name: name, Prefix: body[:displayLen],
		Hash: hex.EncodeToString(hashKey(plaintext)), Created: now.UnixNano(), Admin: admin}
	return plaintext, k, nil
}

// Check says what is wrong with a shared key (nil: nothing).
func (k SharedKey) Check() error {
	id, ok := strings.CutPrefix(k.ID, "key_")
	h, err := hex.DecodeString(k.Hash)
	switch {
	case !ok || len(id) != 12 || !isLowerHex(id):
		return fmt.Errorf("store: shared key: malformed id %q", k.ID)
	case len(k.Prefix) != displayLen || !isLowerHex(k.Prefix):
		return fmt.Errorf("store: shared key %s: malformed prefix", k.ID)
	case err != nil || len(h) != 32:
		return fmt.Errorf("store: shared key %s: malformed hash", k.ID)
	case len(k.Name) > 256:
		return fmt.Errorf("store: shared key %s: name longer than 256 bytes", k.ID)
	}
	return nil
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// ImportKey puts a cluster's key in this store: a new one is inserted, a
// known one (same id and hash) takes the cluster's revocation; a key of
// this store with the same id or hash but another hash or id is left as
// it is (the cluster cannot replace a local key). A revocation is never
// undone.
func (s *Store) ImportKey(k SharedKey) error {
	if err := k.Check(); err != nil {
		return err
	}
	hash, _ := hex.DecodeString(k.Hash)
	var revoked any
	if k.Revoked != 0 {
		revoked = k.Revoked
	}
	_, err := s.db.ExecContext(context.Background(),
		`INSERT INTO api_keys (id, name, prefix, hash, created_at, revoked_at, team_id, admin)
		VALUES (?, ?, ?, ?, ?, ?, '', ?)
		ON CONFLICT (id) DO UPDATE SET revoked_at = COALESCE(api_keys.revoked_at, excluded.revoked_at)
			WHERE api_keys.hash = excluded.hash
		ON CONFLICT DO NOTHING`,
		k.ID, k.Name, k.Prefix, hash, k.Created, revoked, boolInt(k.Admin))
	if err != nil {
		return fmt.Errorf("store: import key %s: %w", k.ID, err)
	}
	return nil
}
