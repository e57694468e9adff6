package cluster

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/proxy"
)

// Node-to-node authentication: a request one node makes of another (the
// internal routes under /cluster/, and the front's forwarded API and proxy
// requests) carries AuthHeader, an HMAC-SHA256 under the cluster's node
// key (the Secret KeySecret) of what the signature is for (Purpose), the
// signing node's name, the name of the node it is for, the time, the
// method and the path with its query. A signature is good for MaxSkew
// either side of the verifier's clock; within that window it can be
// replayed for the same purpose, node, method and path (the routes it
// guards are idempotent or keyed by the sandbox's id), and for nothing
// else: traffic forwarded to a sandbox's node reaches the sandbox, which
// must not be able to turn the signature it sees into one for the
// internal routes or another node (and the proxy removes it before
// forwarding: see proxy.NodeAuthHeader).
const (
	AuthHeader    = proxy.NodeAuthHeader
	KeySecret     = "cage-cluster"
	KeySecretData = "node-key"
	KeyLen        = 32
	MaxSkew       = 60 * time.Second
)

// Purpose is what a node signature is for; one made for a purpose never
// verifies for another.
type Purpose string

const (
	// ForInternal: the internal routes (/cluster/...).
	ForInternal Purpose = "internal"
	// ForAPI: an API request the front forwards to the sandbox's node
	// (the client's key is checked there as anywhere; the signature says
	// its rates were taken).
	ForAPI Purpose = "api"
	// ForTraffic: sandbox traffic the front forwards to the proxy of the
	// sandbox's node (whose tokens the owner's proxy checks).
	ForTraffic Purpose = "traffic"
)

// ErrAuth marks a request without a good node signature.
var ErrAuth = errors.New("node authentication failed")

// now is the clock of Sign and Verify (tests move it).
var now = time.Now

// Sign adds to r the AuthHeader of node from, for node to and purpose p,
// under key.
func Sign(r *http.Request, key []byte, from, to string, p Purpose) {
	t := strconv.FormatInt(now().Unix(), 10)
	r.Header.Set(AuthHeader, "node="+from+",t="+t+",sig="+hex.EncodeToString(mac(key, p, from, to, t, r)))
}

// Verify checks r's AuthHeader under key, as made for node self and
// purpose p, and returns the signing node's name. It reads no body.
func Verify(r *http.Request, key []byte, self string, p Purpose) (node string, err error) {
	h := r.Header.Get(AuthHeader)
	if h == "" {
		return "", fmt.Errorf("%w: no %s header", ErrAuth, AuthHeader)
	}
	if len(key) < KeyLen {
		return "", fmt.Errorf("%w: this node has no node key", ErrAuth)
	}
	var t, sig string
	for _, part := range strings.Split(h, ",") {
		k, v, _ := strings.Cut(part, "=")
		switch k {
		case "node":
			node = v
		case "t":
			t = v
		case "sig":
			sig = v
		default:
			return "", fmt.Errorf("%w: malformed %s header", ErrAuth, AuthHeader)
		}
	}
	if node == "" || len(validation.IsDNS1123Subdomain(node)) > 0 {
		return "", fmt.Errorf("%w: malformed node name", ErrAuth)
	}
	unix, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return "", fmt.Errorf("%w: malformed time", ErrAuth)
	}
	if d := now().Sub(time.Unix(unix, 0)); d > MaxSkew || d < -MaxSkew {
		return "", fmt.Errorf("%w: signature time is %v away from this node's clock", ErrAuth, d.Round(time.Second))
	}
	got, err := hex.DecodeString(sig)
	if err != nil || !hmac.Equal(got, mac(key, p, node, self, t, r)) {
		return "", fmt.Errorf("%w: bad signature", ErrAuth)
	}
	return node, nil
}

func mac(key []byte, p Purpose, from, to, t string, r *http.Request) []byte {
	m := hmac.New(sha256.New, key)
	// Node names are DNS subdomains and the purposes fixed words: none
	// holds "|", so no two inputs run together.
	m.Write([]byte("cage-node-auth-v2|" + string(p) + "|" + from + "|" + to + "|" + t + "|" + r.Method + "|" + r.URL.RequestURI()))
	return m.Sum(nil)
}

// NodeKey returns the cluster's node key from the Secret KeySecret in ns,
// creating it (KeyLen random bytes) when there is none: the first node to
// start makes it, the others read it.
func NodeKey(ctx context.Context, c *kube.Client, ns string) ([]byte, error) {
	secrets := c.CoreV1().Secrets(ns)
	for attempt := 0; attempt < 3; attempt++ {
		s, err := secrets.Get(ctx, KeySecret, metav1.GetOptions{})
		if err == nil {
			k := s.Data[KeySecretData]
			if len(k) < KeyLen {
				return nil, fmt.Errorf("cluster: secret %s/%s: %s is %d bytes, not %d", ns, KeySecret, KeySecretData, len(k), KeyLen)
			}
			return k, nil
		}
		if !kube.IsNotFound(err) {
			return nil, fmt.Errorf("cluster: secret %s/%s: %w", ns, KeySecret, err)
		}
		k := make([]byte, KeyLen)
		_, _ = rand.Read(k)
		_, err = secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: KeySecret, Namespace: ns, Labels: map[string]string{LabelManagedBy: "cage"}},
			Type:       corev1.SecretTypeOpaque,
			Data:       map[string][]byte{KeySecretData: k},
		}, metav1.CreateOptions{})
		if err == nil {
			return k, nil
		}
		if !kube.IsAlreadyExists(err) {
			return nil, fmt.Errorf("cluster: create secret %s/%s: %w", ns, KeySecret, err)
		}
		// another node made it first: read theirs
	}
	return nil, fmt.Errorf("cluster: secret %s/%s: could not read or create it", ns, KeySecret)
}
