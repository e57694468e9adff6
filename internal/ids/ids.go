// Package ids mints the names and secrets of sandboxes, in one place: ids
// (20 lowercase hex characters, as E2B's) and access and traffic tokens
// (48 hex characters of crypto/rand).
package ids

import (
	"crypto/rand"
	"encoding/hex"
)

// NewID returns a fresh sandbox id.
func NewID() string { return random(10) }

// NewToken returns a fresh token: an agent's access token, a sandbox's
// traffic token.
func NewToken() string { return random(24) }

// Hostname is a sandbox's host name inside it: cage- and the first 8
// characters of its id.
func Hostname(id string) string { return "cage-" + id[:min(8, len(id))] }

func random(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand panics rather)
	return hex.EncodeToString(b)
}

// Valid reports whether id has NewID's format: 20 lowercase hex characters.
func Valid(id string) bool {
	if len(id) != 20 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
