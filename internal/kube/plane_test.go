package kube

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// compact compacts etcd's history up to now, as the API server does every
// five minutes: a watch from an older resourceVersion is answered 410.
func compact(t *testing.T, p *kubeplane.Plane) {
	post := func(path, body string) map[string]any {
		resp, err := http.Post(p.EtcdURL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("etcd %s: %d %v", path, resp.StatusCode, err)
		}
		return out
	}
	h, _ := post("/v3/kv/range", `{"key":"Lw=="}`)["header"].(map[string]any)
	rev, _ := h["revision"].(string)
	if rev == "" {
		t.Fatalf("etcd revision: %v", h)
	}
	post("/v3/kv/compaction", `{"revision":"`+rev+`","physical":true}`)
}

// relay stands between a client and the real API server: it can make the
// next watch start from resourceVersion 1 (long compacted away: the API
// server answers 410) and can cut the client off (503 to everything).
type relay struct {
	srv      *httptest.Server
	oldWatch atomic.Bool
	cut      atomic.Bool
	watches  atomic.Int32
}

func newRelay(t *testing.T, p *kubeplane.Plane) *relay {
	ca, err := os.ReadFile(p.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	target, _ := url.Parse(p.URL)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	rp.FlushInterval = -1
	r := &relay{}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if r.cut.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if q := req.URL.Query(); q.Get("watch") == "true" {
			r.watches.Add(1)
			if r.oldWatch.CompareAndSwap(true, false) {
				q.Set("resourceVersion", "1")
				req.URL.RawQuery = q.Encode()
			}
		}
		rp.ServeHTTP(w, req)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// TestAgainstPlane runs the client against a real API server (kubeplane).
func TestAgainstPlane(t *testing.T) {
	// Secrets unwatched-cached: a watch from a compacted version reaches
	// etcd, as every watch does on a cache that has lost its window.
	p := kubeplane.Start(t, kubeplane.Options{APIServerArgs: []string{"--watch-cache-sizes=secrets#0"}})
	cfg, err := LoadKubeconfig(p.MustKubeconfig(t, kubeplane.Admin))
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(cfg, Options{UserAgent: "cage/kube-test"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ns := "kube-test"
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	via := func(r *relay) *Client {
		rc, err := New(&Config{Server: r.srv.URL, Token: p.Token(kubeplane.Admin)}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		return rc
	}
	t.Run("Typed", func(t *testing.T) { testTyped(t, c, ns) })
	t.Run("WatchRelistsOnGone", func(t *testing.T) {
		r := newRelay(t, p)
		testRelist(t, c, via(r), r, ns, func() { compact(t, p) })
	})
	t.Run("ElectionHandover", func(t *testing.T) {
		r := newRelay(t, p)
		testElection(t, via(r), c, r, ns)
	})
}

// testTyped: create, get, update with a stale resourceVersion (Conflict),
// merge patch, delete with a wrong UID precondition (Conflict), delete,
// and the API server's NotFound and AlreadyExists.
func testTyped(t *testing.T, c *Client, ns string) {
	ctx := context.Background()
	secrets := c.CoreV1().Secrets(ns)
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s1", Labels: map[string]string{"k": "v"}},
		Data: map[string][]byte{"a": []byte("1")}}
	made, err := secrets.Create(ctx, s, metav1.CreateOptions{})
	if err != nil || made.UID == "" || made.ResourceVersion == "" {
		t.Fatalf("create: %+v, %v", made, err)
	}
	if _, err := secrets.Create(ctx, s, metav1.CreateOptions{}); !IsAlreadyExists(err) {
		t.Fatalf("second create: %v, want AlreadyExists", err)
	}
	got, err := secrets.Get(ctx, "s1", metav1.GetOptions{})
	if err != nil || string(got.Data["a"]) != "1" {
		t.Fatalf("get: %+v, %v", got, err)
	}
	got.Data["a"] = []byte("2")
	if _, err := secrets.Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Update(ctx, got, metav1.UpdateOptions{}); !IsConflict(err) { // got's resourceVersion is stale now
		t.Fatalf("stale update: %v, want Conflict", err)
	}
	pt, err := secrets.Patch(ctx, "s1", types.MergePatchType, []byte(`{"metadata":{"annotations":{"x":"y"}}}`), metav1.PatchOptions{})
	if err != nil || pt.Annotations["x"] != "y" || string(pt.Data["a"]) != "2" {
		t.Fatalf("patch: %+v, %v", pt, err)
	}
	l, err := secrets.List(ctx, metav1.ListOptions{LabelSelector: "k=v"})
	if err != nil || len(l.Items) != 1 {
		t.Fatalf("list: %v, %v", l, err)
	}
	wrong := types.UID("not-its-uid")
	if err := secrets.Delete(ctx, "s1", metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &wrong}}); !IsConflict(err) {
		t.Fatalf("delete with a wrong uid: %v, want Conflict", err)
	}
	zero := int64(0)
	if err := secrets.Delete(ctx, "s1", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if _, err := secrets.Get(ctx, "s1", metav1.GetOptions{}); !IsNotFound(err) || !strings.Contains(err.Error(), `"s1" not found`) {
		t.Fatalf("get after delete: %v, want NotFound", err)
	}
}

// recorder is a handler that records what it is told.
type recorder struct {
	mu                   sync.Mutex
	added, updated, gone []string
}

func (r *recorder) handlers() Handlers[corev1.Secret] {
	rec := func(l *[]string) func(*corev1.Secret) {
		return func(s *corev1.Secret) { r.mu.Lock(); *l = append(*l, s.Name); r.mu.Unlock() }
	}
	return Handlers[corev1.Secret]{Add: rec(&r.added), Update: func(_, s *corev1.Secret) { rec(&r.updated)(s) }, Delete: rec(&r.gone)}
}

func (r *recorder) has(l *[]string, name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range *l {
		if n == name {
			return true
		}
	}
	return false
}

// testRelist: the informer's first watch starts from a resourceVersion
// the API server has compacted away; the server answers 410, and the
// informer lists again (at once) and then watches: what changed meanwhile
// reaches the cache and the handlers, and the label selector holds.
func testRelist(t *testing.T, admin, c *Client, rel *relay, ns string, compact func()) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	secrets := admin.CoreV1().Secrets(ns)
	mk := func(name, label string) {
		if _, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{"informer": label}}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mk("before", "yes")
	mk("other", "no")
	compact()
	// The server's own answer to a watch from a compacted version.
	w, err := c.CoreV1().Secrets(ns).Watch(ctx, metav1.ListOptions{ResourceVersion: "1"})
	if err != nil {
		if !IsGone(err) {
			t.Fatalf("watch from version 1: %v, want 410", err)
		}
	} else {
		ev, ok := <-w.ResultChan()
		st, isStatus := ev.Object.(*metav1.Status)
		if !ok || ev.Type != Error || !isStatus || st.Code != 410 || !IsGone(&StatusError{Status: *st}) {
			t.Fatalf("watch from version 1: %v %+v, want a 410 error event", ev.Type, ev.Object)
		}
		w.Stop()
	}
	rel.oldWatch.Store(true)
	inf := NewInformer(c.CoreV1().Secrets(ns), metav1.ListOptions{LabelSelector: "informer=yes"})
	var rec recorder
	inf.AddHandlers(rec.handlers())
	inf.Start(ctx)
	if !WaitForSync(ctx, inf.HasSynced) {
		t.Fatal("no sync")
	}
	if _, err := inf.Get("before"); err != nil {
		t.Fatalf("cache after the first list: %v", err)
	}
	if _, err := inf.Get("other"); !IsNotFound(err) {
		t.Fatalf("a secret the selector leaves out is in the cache: %v", err)
	}
	waitFor(t, func() bool { return inf.Lists() >= 2 })
	mk("after", "yes")
	if err := secrets.Delete(ctx, "before", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		_, e1 := inf.Get("after")
		_, e2 := inf.Get("before")
		return e1 == nil && IsNotFound(e2)
	})
	if n := inf.Lists(); n != 2 {
		t.Errorf("%d lists, want 2 (the first, and one after the 410)", n)
	}
	if !rec.has(&rec.added, "before") || !rec.has(&rec.updated, "before") || !rec.has(&rec.added, "after") ||
		!rec.has(&rec.gone, "before") || rec.has(&rec.added, "other") {
		t.Errorf("handlers told: added %v updated %v deleted %v", rec.added, rec.updated, rec.gone)
	}
	if len(inf.List()) != 1 {
		t.Errorf("cache holds %d objects, want 1", len(inf.List()))
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// testElection: two electors of one Lease; a leads and b waits while a
// renews; a is cut off from the API server, stops leading once it has
// not renewed within its renew deadline, and b takes the Lease once a's
// term has run out (never two leaders at once); b released on cancel,
// a third elector takes the Lease at its first try.
func testElection(t *testing.T, a, b *Client, r *relay, ns string) {
	le := func(c *Client, id string) *Elector {
		return &Elector{Leases: c.CoordinationV1().Leases(ns), Name: "handover", Identity: id,
			// Each renewal may take up to RetryPeriod, and a's term holds
			// while some succeed within RenewDeadline: on a loaded host
			// (etcd fsyncs every write) a 500 ms try and a 2 s deadline
			// could lose the Lease while the test says a renews it.
			LeaseDuration: 8 * time.Second, RenewDeadline: 5 * time.Second, RetryPeriod: time.Second}
	}
	holder := func() (string, int32) {
		l, err := b.CoordinationV1().Leases(ns).Get(context.Background(), "handover", metav1.GetOptions{})
		if err != nil {
			return "", -1
		}
		return deref(l.Spec.HolderIdentity), *l.Spec.LeaseTransitions
	}
	var aLeads, bLeads atomic.Bool
	aLost, bLed, aDone, bDone := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	go func() {
		defer close(aDone)
		_ = le(a, "a").Run(ctxA, func(ctx context.Context) {
			aLeads.Store(true)
			<-ctx.Done()
			aLeads.Store(false)
			close(aLost)
		})
	}()
	waitFor(t, aLeads.Load)
	eb := le(b, "b")
	eb.ReleaseOnCancel = true
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	twoLeaders := make(chan bool, 1)
	go func() {
		defer close(bDone)
		_ = eb.Run(ctxB, func(ctx context.Context) {
			twoLeaders <- aLeads.Load()
			bLeads.Store(true)
			close(bLed)
			<-ctx.Done()
		})
	}()
	time.Sleep(3 * time.Second) // b stands through several of a's renewals
	if bLeads.Load() {
		t.Fatal("b took the Lease while a renewed it")
	}
	if h, _ := holder(); h != "a" {
		t.Fatalf("holder %q, want a", h)
	}
	r.cut.Store(true) // a's renewals fail from now on
	<-aLost
	<-aDone // a's Run returned: it stopped leading on its own, ctxA still live
	if ctxA.Err() != nil {
		t.Fatal("a's context ended")
	}
	<-bLed
	if <-twoLeaders {
		t.Fatal("b was elected while a still led")
	}
	if h, n := holder(); h != "b" || n != 1 {
		t.Fatalf("holder %q transitions %d, want b and 1", h, n)
	}
	cancelB()
	<-bDone
	if h, _ := holder(); h != "" {
		t.Fatalf("holder %q after b released the Lease, want none", h)
	}
	ec := le(b, "c")
	if !ec.try(context.Background()) {
		t.Fatal("a released Lease was not taken at the first try")
	}
	if h, n := holder(); h != "c" || n != 2 {
		t.Fatalf("holder %q transitions %d, want c and 2", h, n)
	}
}
