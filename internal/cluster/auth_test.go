package cluster

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/ids"
)

var key = bytes.Repeat([]byte{7}, KeyLen)

// signed is a request signed by node for node-b's internal routes.
func signed(method, target, node string) *http.Request {
	r := httptest.NewRequest(method, target, nil)
	Sign(r, key, node, "node-b", ForInternal)
	return r
}

func at(t *testing.T, when time.Time) {
	old := now
	now = func() time.Time { return when }
	t.Cleanup(func() { now = old })
}

func TestSignVerify(t *testing.T) {
	r := signed("POST", "/cluster/pods/"+testID+"/start?x=1", "node-a")
	node, err := Verify(r, key, "node-b", ForInternal)
	if err != nil || node != "node-a" {
		t.Fatalf("Verify = %q, %v", node, err)
	}
}

func TestVerifyRefuses(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	at(t, t0)
	good := signed("POST", "/cluster/pods/"+testID+"/start?x=1", "node-a")
	cases := map[string]func() *http.Request{
		"no header": func() *http.Request { return httptest.NewRequest("POST", "/cluster/pods/x/start", nil) },
		"tampered path": func() *http.Request {
			r := good.Clone(context.Background())
			r.URL.Path = "/cluster/pods/ffffffffffffffffffff/start"
			return r
		},
		"tampered query": func() *http.Request {
			r := good.Clone(context.Background())
			r.URL.RawQuery = "x=2"
			return r
		},
		"other method": func() *http.Request {
			r := good.Clone(context.Background())
			r.Method = "DELETE"
			return r
		},
		"wrong node name": func() *http.Request {
			r := good.Clone(context.Background())
			r.Header.Set(AuthHeader, strings.Replace(r.Header.Get(AuthHeader), "node=node-a", "node=node-b", 1))
			return r
		},
		"malformed node name": func() *http.Request {
			r := signed("POST", "/cluster/pods/x/start", "Node_A")
			return r
		},
		"other key": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/x/start", nil)
			Sign(r, bytes.Repeat([]byte{8}, KeyLen), "node-a", "node-b", ForInternal)
			return r
		},
		// What a sandbox sees of traffic forwarded to it (were the proxy
		// not to remove it), or of an API request, is no signature for
		// the internal routes.
		"made for traffic": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/"+testID+"/start?x=1", nil)
			Sign(r, key, "node-a", "node-b", ForTraffic)
			return r
		},
		"made for the API": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/"+testID+"/start?x=1", nil)
			Sign(r, key, "node-a", "node-b", ForAPI)
			return r
		},
		"made for another node": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/"+testID+"/start?x=1", nil)
			Sign(r, key, "node-a", "node-c", ForInternal)
			return r
		},
		"garbage": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/x/start", nil)
			r.Header.Set(AuthHeader, "node=a,t=1,sig=zz,extra=1")
			return r
		},
		"no sig": func() *http.Request {
			r := httptest.NewRequest("POST", "/cluster/pods/x/start", nil)
			r.Header.Set(AuthHeader, "node=a,t=1800000000")
			return r
		},
	}
	for name, mk := range cases {
		r := mk()
		if node, err := Verify(r, key, "node-b", ForInternal); !errors.Is(err, ErrAuth) {
			t.Errorf("%s: Verify = %q, %v; want ErrAuth", name, node, err)
		}
	}
	if _, err := Verify(good, nil, "node-b", ForInternal); !errors.Is(err, ErrAuth) {
		t.Errorf("no key: err = %v", err)
	}
	// Replay: good within ±60 s, refused outside.
	for d, ok := range map[time.Duration]bool{59 * time.Second: true, -59 * time.Second: true,
		61 * time.Second: false, -61 * time.Second: false, time.Hour: false} {
		at(t, t0.Add(d))
		_, err := Verify(good, key, "node-b", ForInternal)
		if (err == nil) != ok {
			t.Errorf("replayed %v later: err = %v, want ok=%v", d, err, ok)
		}
	}
}

// TestNodeKey runs against the package's control plane, each case in a
// namespace of its own.
func TestNodeKey(t *testing.T) {
	c := newPlane(t)
	ctx := context.Background()
	ns := func() string {
		name := "nodekey-" + strings.ToLower(ids.NewID())
		if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}},
			metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		return name
	}
	ns1 := ns()
	k1, err := NodeKey(ctx, c, ns1)
	if err != nil || len(k1) != KeyLen {
		t.Fatalf("first NodeKey = %x, %v", k1, err)
	}
	k2, err := NodeKey(ctx, c, ns1)
	if err != nil || !bytes.Equal(k1, k2) {
		t.Fatalf("second NodeKey = %x, %v; want the first's", k2, err)
	}
	if bytes.Equal(k1, make([]byte, KeyLen)) {
		t.Fatal("a key of zeros")
	}
	// A short key in the Secret is refused, not used.
	ns2 := ns()
	if _, err := c.CoreV1().Secrets(ns2).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: KeySecret, Namespace: ns2},
		Data: map[string][]byte{KeySecretData: []byte("short")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if k, err := NodeKey(ctx, c, ns2); err == nil {
		t.Fatalf("short key accepted: %x", k)
	}
}
