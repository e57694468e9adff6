package store

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

var keyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

func TestCreateKeyStoresOnlyHash(t *testing.T) {
	dir := t.TempDir()
	s := openTest(t, dir)
	plain, k, err := s.CreateKey("laptop")
	if err != nil {
		t.Fatal(err)
	}
	if !keyRE.MatchString(plain) {
		t.Fatalf("key %q is not e2b_ + 40 lowercase hex", plain)
	}
	if !regexp.MustCompile(`^key_[0-9a-f]{12}$`).MatchString(k.ID) {
		t.Errorf("id %q", k.ID)
	}
	if k.Name != "laptop" || k.Prefix != plain[4:12] || k.RevokedAt != nil || k.LastUsed != nil {
		t.Errorf("key %+v", k)
	}
	if d := time.Since(k.CreatedAt); d < 0 || d > time.Minute {
		t.Errorf("CreatedAt %v", k.CreatedAt)
	}
	plain2, k2, err := s.CreateKey("other")
	if err != nil || plain2 == plain || k2.ID == k.ID {
		t.Fatalf("second key %q %+v %v", plain2, k2, err)
	}

	// The raw table holds the SHA-256, nothing that contains the key.
	var hash []byte
	var prefix string
	if err := s.db.QueryRow("SELECT hash, prefix FROM api_keys WHERE id = ?", k.ID).Scan(&hash, &prefix); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256([]byte(plain)); !bytes.Equal(hash, sum[:]) || prefix != k.Prefix {
		t.Errorf("stored hash %x prefix %q", hash, prefix)
	}
	secret := plain[len("e2b_"):]
	checkFiles := func(when string) {
		t.Helper()
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(b, []byte(secret)) || bytes.Contains(b, []byte(strings.ToUpper(secret))) {
				t.Errorf("%s: %s contains the plaintext key", when, e.Name())
			}
		}
	}
	checkFiles("open") // the row is still in the WAL
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	checkFiles("closed") // checkpointed into cage.db
}

func TestVerifyKey(t *testing.T) {
	s := openTest(t, t.TempDir())
	plain, k, err := s.CreateKey("ci")
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.VerifyKey(plain)
	if err != nil || got.ID != k.ID || got.Name != "ci" {
		t.Fatalf("VerifyKey = %+v, %v", got, err)
	}
	flip := func(c byte) string {
		if c == '0' {
			return "1"
		}
		return "0"
	}
	for name, bad := range map[string]string{
		"empty":          "",
		"wrong":          "e2b_" + strings.Repeat("0", 40),
		"same prefix":    plain[:12] + flip(plain[12]) + plain[13:],
		"last char":      plain[:43] + flip(plain[43]),
		"uppercase":      "e2b_" + strings.ToUpper(plain[4:]),
		"no prefix":      plain[4:],
		"other prefix":   "e2c_" + plain[4:],
		"short":          plain[:43],
		"long":           plain + "0",
		"not hex":        plain[:43] + "g",
		"space":          " " + plain,
		"newline":        plain + "\n",
		"just the e2b_":  "e2b_",
		"sql":            "e2b_' OR 1=1 --" + strings.Repeat("a", 25),
		"id not key":     k.ID,
		"prefix not key": k.Prefix,
	} {
		if got, err := s.VerifyKey(bad); !errors.Is(err, ErrNotFound) {
			t.Errorf("%s (%q): %+v, %v; want ErrNotFound", name, bad, got, err)
		}
	}

	// Two keys sharing a display prefix are told apart by the hash.
	twin := "e2b_" + k.Prefix + strings.Repeat("7", 32)
	if twin != plain {
		if _, err := s.db.Exec("INSERT INTO api_keys (id, name, prefix, hash, created_at) VALUES ('key_twin', 'twin', ?, ?, 1)",
			k.Prefix, hashKey(twin)); err != nil {
			t.Fatal(err)
		}
		if got, err := s.VerifyKey(twin); err != nil || got.ID != "key_twin" {
			t.Errorf("twin: %+v %v", got, err)
		}
		if got, err := s.VerifyKey(plain); err != nil || got.ID != k.ID {
			t.Errorf("original after twin: %+v %v", got, err)
		}
		if _, err := s.RevokeKey(k.Prefix); !errors.Is(err, ErrAmbiguous) {
			t.Errorf("revoke shared prefix: %v, want ErrAmbiguous", err)
		}
	}

	if _, err := s.RevokeKey(k.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := s.VerifyKey(plain); !errors.Is(err, ErrNotFound) {
		t.Errorf("revoked key verified: %+v %v", got, err)
	}
}

func TestVerifyKeyLastUsedThrottled(t *testing.T) {
	s := openTest(t, t.TempDir())
	now := ts(1_700_000_000)
	s.now = func() time.Time { return now }
	plain, _, err := s.CreateKey("x")
	if err != nil {
		t.Fatal(err)
	}
	lastUsed := func() time.Time {
		t.Helper()
		keys, err := s.ListKeys()
		if err != nil || len(keys) != 1 || keys[0].LastUsed == nil {
			t.Fatalf("ListKeys: %+v %v", keys, err)
		}
		return *keys[0].LastUsed
	}
	got, err := s.VerifyKey(plain)
	if err != nil || got.LastUsed == nil || !got.LastUsed.Equal(now) {
		t.Fatalf("first use: %+v %v", got, err)
	}
	t0 := now
	now = now.Add(59 * time.Second)
	if got, _ := s.VerifyKey(plain); !got.LastUsed.Equal(t0) || !lastUsed().Equal(t0) {
		t.Errorf("updated within a minute: %v", got.LastUsed)
	}
	now = t0.Add(time.Minute)
	if got, _ := s.VerifyKey(plain); !got.LastUsed.Equal(now) || !lastUsed().Equal(now) {
		t.Errorf("not updated after a minute: %v", got.LastUsed)
	}
	t1 := now
	now = t0 // the clock steps back: LastUsed must not go backwards
	if got, _ := s.VerifyKey(plain); !got.LastUsed.Equal(t1) || !lastUsed().Equal(t1) {
		t.Errorf("went backwards: %v", got.LastUsed)
	}
}

func TestRevokeAndListKeys(t *testing.T) {
	s := openTest(t, t.TempDir())
	now := ts(1_700_000_000)
	s.now = func() time.Time { now = now.Add(time.Second); return now }
	p1, k1, _ := s.CreateKey("one")
	p2, k2, _ := s.CreateKey("two")
	p3, k3, err := s.CreateKey("three")
	if err != nil {
		t.Fatal(err)
	}

	r1, err := s.RevokeKey(k1.ID)
	if err != nil || r1.ID != k1.ID || r1.RevokedAt == nil {
		t.Fatalf("revoke by id: %+v %v", r1, err)
	}
	again, err := s.RevokeKey(k1.ID)
	if err != nil || again.RevokedAt == nil || !again.RevokedAt.Equal(*r1.RevokedAt) {
		t.Errorf("revoke twice: %+v %v (first at %v)", again, err, r1.RevokedAt)
	}
	r2, err := s.RevokeKey(k2.Prefix)
	if err != nil || r2.ID != k2.ID {
		t.Errorf("revoke by prefix: %+v %v", r2, err)
	}
	for _, missing := range []string{"", "key_000000000000", "zzzzzzzz", k3.Prefix[:4], p3} {
		if _, err := s.RevokeKey(missing); !errors.Is(err, ErrNotFound) {
			t.Errorf("revoke %q: %v, want ErrNotFound", missing, err)
		}
	}

	keys, err := s.ListKeys()
	if err != nil || len(keys) != 3 {
		t.Fatalf("ListKeys: %v %v", keys, err)
	}
	for i, want := range []struct {
		k       *APIKey
		revoked bool
	}{{k1, true}, {k2, true}, {k3, false}} {
		got := keys[i]
		if got.ID != want.k.ID || got.Name != want.k.Name || got.Prefix != want.k.Prefix ||
			!got.CreatedAt.Equal(want.k.CreatedAt) || (got.RevokedAt != nil) != want.revoked {
			t.Errorf("key %d: %+v, want %+v revoked=%v", i, got, want.k, want.revoked)
		}
	}
	if _, err := s.VerifyKey(p1); !errors.Is(err, ErrNotFound) {
		t.Error("revoked key 1 verifies")
	}
	if _, err := s.VerifyKey(p2); !errors.Is(err, ErrNotFound) {
		t.Error("revoked key 2 verifies")
	}
	if _, err := s.VerifyKey(p3); err != nil {
		t.Errorf("live key 3: %v", err)
	}
	// The display form "e2b_" + prefix works too.
	if r3, err := s.RevokeKey("e2b_" + k3.Prefix); err != nil || r3.ID != k3.ID {
		t.Errorf("revoke e2b_prefix: %+v %v", r3, err)
	}
}
