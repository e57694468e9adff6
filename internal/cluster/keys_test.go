package cluster

import (
	"context"
	"errors"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/store"
)

// TestKeysShared: a key made for the cluster reaches every node's store
// (here two) and verifies there; revoked in the cluster, it stops
// verifying on each; a malformed entry is skipped, not fatal; the Secret
// holds no plaintext.
func TestKeysShared(t *testing.T) {
	c := newPlane(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stores []*store.Store
	for i := 0; i < 2; i++ {
		st, err := store.Open(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		if err := SyncKeys(ctx, c, testNS, st, nil); err != nil {
			t.Fatal(err)
		}
		stores = append(stores, st)
	}
	plain, k, err := CreateKey(ctx, c, testNS, "ci", false)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range stores {
		wait(t, func() bool { _, err := st.VerifyKey(plain); return err == nil })
		got, _ := st.VerifyKey(plain)
		if got.ID != k.ID || got.Admin || got.Name != "ci" {
			t.Fatalf("node %d: key %+v", i, got)
		}
	}
	s, err := c.CoreV1().Secrets(testNS).Get(ctx, KeysSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for id, raw := range s.Data {
		if strings.Contains(string(raw), plain[4:]) {
			t.Fatalf("entry %s holds the plaintext", id)
		}
	}
	// A malformed entry beside the good ones.
	s.Data["key_bad"] = []byte("{not json")
	if _, err := c.CoreV1().Secrets(testNS).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	plain2, _, err := CreateKey(ctx, c, testNS, "second", true)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range stores {
		wait(t, func() bool { k, err := st.VerifyKey(plain2); return err == nil && k.Admin })
	}
	if _, err := ListKeys(ctx, c, testNS); err == nil {
		t.Fatal("ListKeys read a malformed entry without an error")
	}
	delete(s.Data, "key_bad")
	s, _ = c.CoreV1().Secrets(testNS).Get(ctx, KeysSecret, metav1.GetOptions{})
	delete(s.Data, "key_bad")
	if _, err := c.CoreV1().Secrets(testNS).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	if _, err := RevokeKey(ctx, c, testNS, "key_nothere0000"); !errors.Is(err, ErrNoKey) {
		t.Fatalf("revoke of no key: %v", err)
	}
	r, err := RevokeKey(ctx, c, testNS, plain[:12]) // by its display prefix, e2b_ included
	if err != nil || r.ID != k.ID || r.Revoked == 0 {
		t.Fatalf("revoke: %+v %v", r, err)
	}
	for _, st := range stores {
		wait(t, func() bool { _, err := st.VerifyKey(plain); return errors.Is(err, store.ErrNotFound) })
	}
	keys, err := ListKeys(ctx, c, testNS)
	if err != nil || len(keys) != 2 || keys[0].ID != k.ID || keys[0].Revoked == 0 {
		t.Fatalf("list after the revocation: %+v %v", keys, err)
	}
	// A node that starts later gets the key revoked from the start.
	late, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	if err := SyncKeys(ctx, c, testNS, late, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := late.VerifyKey(plain); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("revoked key on a node that started after: %v", err)
	}
	if _, err := late.VerifyKey(plain2); err != nil {
		t.Fatalf("live key on a node that started after: %v", err)
	}
}
