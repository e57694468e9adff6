package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/store"
)

// KeysSecret is the Secret that shares API keys across the cluster: one
// entry per key (its id -> JSON of store.SharedKey: name, prefix, hash,
// admin, revocation; never the plaintext). A revoked key stays in it, as
// a tombstone, so that a node that was down when it was revoked revokes
// it too.
const KeysSecret = "cage-api-keys"

// ErrNoKey is a key the cluster does not have.
var ErrNoKey = errors.New("no such API key in the cluster")

// SyncKeys keeps st's keys in step with the cluster's Secret until ctx
// ends: every key in it is imported (store.ImportKey), each revocation
// applied. It returns once the first sync is done (or ctx ends).
func SyncKeys(ctx context.Context, c *kube.Client, ns string, st *store.Store, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	inf := kube.NewInformer(c.CoreV1().Secrets(ns), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", KeysSecret).String()})
	apply := func(s *corev1.Secret) {
		if s.Name == KeysSecret {
			importKeys(s, st, log)
		}
	}
	inf.AddHandlers(kube.Handlers[corev1.Secret]{Add: apply, Update: func(_, s *corev1.Secret) { apply(s) }})
	inf.Start(ctx)
	if !kube.WaitForSync(ctx, inf.HasSynced) {
		return fmt.Errorf("cluster: keys: informer did not sync: %w", ctx.Err())
	}
	return nil
}

// importKeys imports every key of the Secret; a malformed entry is
// logged and skipped.
func importKeys(s *corev1.Secret, st *store.Store, log *slog.Logger) {
	for id, raw := range s.Data {
		var k store.SharedKey
		if err := json.Unmarshal(raw, &k); err != nil || k.ID != id {
			log.Warn("cluster: keys: malformed entry in the Secret", "secret", KeysSecret, "entry", id)
			continue
		}
		if err := st.ImportKey(k); err != nil {
			log.Warn("cluster: keys: import", "key", id, "err", err)
		}
	}
}

// sharedKeys reads the Secret's keys (none when there is no Secret).
func sharedKeys(s *corev1.Secret) ([]store.SharedKey, error) {
	var out []store.SharedKey
	for id, raw := range s.Data {
		var k store.SharedKey
		if err := json.Unmarshal(raw, &k); err != nil || k.ID != id {
			return nil, fmt.Errorf("cluster: keys: malformed entry %q in Secret %s", id, KeysSecret)
		}
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created < out[j].Created })
	return out, nil
}

// ListKeys returns the cluster's keys, revoked ones included, oldest first.
func ListKeys(ctx context.Context, c *kube.Client, ns string) ([]store.SharedKey, error) {
	s, err := c.CoreV1().Secrets(ns).Get(ctx, KeysSecret, metav1.GetOptions{})
	if kube.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cluster: keys: %w", err)
	}
	return sharedKeys(s)
}

// CreateKey makes a key for the whole cluster: it is added to the
// Secret (made when absent) and every node imports it. The plaintext is
// returned once and kept nowhere.
func CreateKey(ctx context.Context, c *kube.Client, ns, name string, admin bool) (string, store.SharedKey, error) {
	plain, k, err := store.NewSharedKey(name, admin, time.Now())
	if err != nil {
		return "", k, err
	}
	raw, _ := json.Marshal(k)
	err = updateKeys(ctx, c, ns, func(s *corev1.Secret) error {
		s.Data[k.ID] = raw
		return nil
	})
	return plain, k, err
}

// RevokeKey revokes a cluster key, by id or display prefix (with or
// without "e2b_"), keeping its entry as a tombstone. Revoking a revoked
// key keeps the first time. ErrNoKey when none matches.
func RevokeKey(ctx context.Context, c *kube.Client, ns, idOrPrefix string) (store.SharedKey, error) {
	var out store.SharedKey
	prefix := strings.TrimPrefix(idOrPrefix, store.KeyPrefix)
	err := updateKeys(ctx, c, ns, func(s *corev1.Secret) error {
		keys, err := sharedKeys(s)
		if err != nil {
			return err
		}
		var match []store.SharedKey
		for _, k := range keys {
			if k.ID == idOrPrefix {
				match = []store.SharedKey{k}
				break
			}
			if k.Prefix == prefix {
				match = append(match, k)
			}
		}
		switch len(match) {
		case 0:
			return fmt.Errorf("%w: %q", ErrNoKey, idOrPrefix)
		case 1:
		default:
			return fmt.Errorf("key prefix %q matches %d keys of the cluster, use the id", idOrPrefix, len(match))
		}
		out = match[0]
		if out.Revoked == 0 {
			out.Revoked = time.Now().UnixNano()
		}
		s.Data[out.ID], _ = json.Marshal(out)
		return nil
	})
	return out, err
}

// updateKeys changes the Secret with change, creating it when absent and
// retrying on a conflicting write.
func updateKeys(ctx context.Context, c *kube.Client, ns string, change func(*corev1.Secret) error) error {
	secrets := c.CoreV1().Secrets(ns)
	err := kube.RetryOnConflict(func() error {
		s, err := secrets.Get(ctx, KeysSecret, metav1.GetOptions{})
		if kube.IsNotFound(err) {
			s = &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: KeysSecret, Namespace: ns,
				Labels: map[string]string{LabelManagedBy: "cage"}}, Type: corev1.SecretTypeOpaque,
				Data: map[string][]byte{}}
			if err := change(s); err != nil {
				return err
			}
			_, err = secrets.Create(ctx, s, metav1.CreateOptions{})
			if kube.IsAlreadyExists(err) {
				return kube.NewConflict("secrets", KeysSecret, err)
			}
			return err
		}
		if err != nil {
			return err
		}
		if s.Data == nil {
			s.Data = map[string][]byte{}
		}
		if err := change(s); err != nil {
			return err
		}
		_, err = secrets.Update(ctx, s, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !errors.Is(err, ErrNoKey) && !strings.Contains(err.Error(), "matches") {
		return fmt.Errorf("cluster: keys: %w", err)
	}
	return err
}
