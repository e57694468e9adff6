package store

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"testing"
	"time"
)

// A key made for the cluster verifies on a node that imported it, is
// revoked there when the cluster revokes it (never un-revoked), and
// cannot replace a local key with the same id or hash.
func TestImportSharedKey(t *testing.T) {
	s := openTest(t, t.TempDir())
	plain, k, err := NewSharedKey("ci", true, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.VerifyKey(plain); !errors.Is(err, ErrNotFound) {
		t.Fatalf("before the import: %v", err)
	}
	if err := s.ImportKey(k); err != nil {
		t.Fatal(err)
	}
	if err := s.ImportKey(k); err != nil { // again: nothing changes
		t.Fatal(err)
	}
	got, err := s.VerifyKey(plain)
	if err != nil || got.ID != k.ID || !got.Admin || got.Name != "ci" || got.TeamID != "" {
		t.Fatalf("imported key: %+v %v", got, err)
	}
	var hash []byte
	if err := s.db.QueryRow("SELECT hash FROM api_keys WHERE id = ?", k.ID).Scan(&hash); err != nil {
		t.Fatal(err)
	}
	if want := sha256.Sum256([]byte(plain)); !bytes.Equal(hash, want[:]) {
		t.Fatal("stored hash is not the plaintext's SHA-256")
	}

	// Revoked in the cluster: revoked here; a later entry without the
	// revocation does not bring it back.
	k.Revoked = time.Now().UnixNano()
	if err := s.ImportKey(k); err != nil {
		t.Fatal(err)
	}
	if _, err := s.VerifyKey(plain); !errors.Is(err, ErrNotFound) {
		t.Fatalf("revoked key verifies: %v", err)
	}
	k.Revoked = 0
	if err := s.ImportKey(k); err != nil {
		t.Fatal(err)
	}
	if _, err := s.VerifyKey(plain); !errors.Is(err, ErrNotFound) {
		t.Fatalf("un-revoked by the cluster: %v", err)
	}

	// A shared entry with a local key's id but another hash changes
	// nothing of it: the local plaintext still works, the other does not.
	localPlain, local, err := s.CreateKey("local")
	if err != nil {
		t.Fatal(err)
	}
	evilPlain, evil, _ := NewSharedKey("evil", true, time.Now())
	evil.ID = local.ID
	evil.Revoked = time.Now().UnixNano()
	if err := s.ImportKey(evil); err != nil {
		t.Fatal(err)
	}
	if got, err := s.VerifyKey(localPlain); err != nil || got.Admin {
		t.Fatalf("local key after a clashing import: %+v %v", got, err)
	}
	if _, err := s.VerifyKey(evilPlain); !errors.Is(err, ErrNotFound) {
		t.Fatalf("clashing import verifies: %v", err)
	}
}

// Malformed shared keys are refused with a one-line error, not stored.
func TestImportSharedKeyMalformed(t *testing.T) {
	s := openTest(t, t.TempDir())
	_, good, _ := NewSharedKey("x", false, time.Now())
	for name, mod := range map[string]func(*SharedKey){
		"id":     func(k *SharedKey) { k.ID = "key_../../etc" },
		"prefix": func(k *SharedKey) { k.Prefix = "ABCDEFGH" },
		"hash":   func(k *SharedKey) { k.Hash = hex.EncodeToString([]byte("short")) },
		"name":   func(k *SharedKey) { k.Name = string(make([]byte, 300)) },
	} {
		k := good
		mod(&k)
		if err := s.ImportKey(k); err == nil {
			t.Errorf("%s: imported", name)
		}
	}
	keys, err := s.ListKeys()
	if err != nil || len(keys) != 0 {
		t.Fatalf("keys after malformed imports: %d %v", len(keys), err)
	}
}
