package cluster

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
)

func TestMain(m *testing.M) {
	code := testutil.InOwnNetwork(m)
	if shared.plane != nil {
		shared.plane.Stop()
		_ = os.RemoveAll(shared.plane.Dir)
	}
	os.Exit(code)
}

// shared is the package's one control plane (started by the first test
// that needs it: a plane takes seconds to start).
var shared struct {
	once   sync.Once
	plane  *kubeplane.Plane
	client *kube.Client
	err    error
}

const testNS = "cage"

// standIn is a node of the cluster as the front sees it: a Node with
// cage's labels and annotations, a Lease, and an HTTP server in place of
// its cage serve (the real one is test/cluster's). It answers starts and
// forwarded requests only when they carry a good node signature.
type standIn struct {
	name   string
	srv    *httptest.Server
	starts atomic.Int32
	// startStatus, when set, is the status of its start answers.
	startStatus atomic.Int32
}

// newPlane returns the client (admin) of the package's control plane,
// with the namespace testNS; it skips the test where there is no plane
// (or fails it where CAGE_REQUIRE_WALLS is set).
func newPlane(t *testing.T) *kube.Client {
	if _, err := kubeplane.BinDir(); err != nil {
		kubeplane.Start(t, kubeplane.Options{}) // skips or fails, as it says
	}
	shared.once.Do(func() {
		dir, err := os.MkdirTemp("", "cage-cluster-test-")
		if err != nil {
			shared.err = err
			return
		}
		p, err := kubeplane.Launch(kubeplane.Options{Dir: dir})
		if err != nil {
			shared.err = err
			return
		}
		shared.plane = p
		cfg, err := kube.LoadKubeconfig(p.MustKubeconfig(t, kubeplane.Admin))
		if err != nil {
			shared.err = err
			return
		}
		if shared.client, err = kube.New(cfg, kube.Options{QPS: 500, Burst: 1000}); err != nil {
			shared.err = err
			return
		}
		_, shared.err = shared.client.CoreV1().Namespaces().Create(context.Background(),
			&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNS}}, metav1.CreateOptions{})
	})
	if shared.err != nil {
		t.Fatalf("control plane: %v", shared.err)
	}
	return shared.client
}

func addStandIn(t *testing.T, c *kube.Client, key []byte, name string, walls ...string) *standIn {
	s := &standIn{name: name}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /cluster/pods/{id}/start", func(w http.ResponseWriter, r *http.Request) {
		if _, err := Verify(r, key, name, ForInternal); err != nil {
			apiError(w, http.StatusUnauthorized, err.Error())
			return
		}
		s.starts.Add(1)
		if st := s.startStatus.Load(); st != 0 {
			apiError(w, int(st), "limit reached: this node runs its maximum of sandboxes")
			return
		}
		writeTestJSON(w, http.StatusCreated, store.Sandbox{ID: r.PathValue("id"), AccessToken: "token-" + name, Wall: "process"})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// The stand-in is the node's API and its proxy at once: a request
		// is signed for one or the other, and for this node.
		purpose := ForAPI
		from, err := Verify(r, key, name, purpose)
		if err != nil {
			purpose = ForTraffic
			from, err = Verify(r, key, name, purpose)
		}
		if err != nil {
			apiError(w, http.StatusUnauthorized, err.Error())
			return
		}
		if r.URL.Query().Get("hang") != "" { // a node that never answers
			_, _ = io.Copy(io.Discard, r.Body) // (Go's server sees a client go only once the body is read)
			<-r.Context().Done()
			return
		}
		if r.Header.Get("Upgrade") == "websocket" {
			echoUpgrade(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, "%s %s %s from=%s key=%s host=%s for=%s body=%s\n", name, r.Method, r.URL.RequestURI(), from,
			r.Header.Get("X-API-Key"), r.Host, purpose, body)
		w.(http.Flusher).Flush()
		if r.URL.Query().Get("stream") != "" {
			<-r.Context().Done() // a stream that lasts until the client goes
		}
	})
	s.srv = httptest.NewServer(mux)
	t.Cleanup(s.srv.Close)
	ctx := context.Background()
	labels := map[string]string{NodeLabel: "true", "kubernetes.io/hostname": name}
	for _, w := range walls {
		labels[WallLabelPrefix+w] = "true"
	}
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels,
			Annotations: map[string]string{AnnoAPI: s.srv.URL, AnnoProxy: s.srv.URL}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: Taint, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	}
	n, err := c.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	room := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"),
		corev1.ResourceMemory: resource.MustParse("8Gi"), corev1.ResourcePods: resource.MustParse("100")}
	n.Status.Capacity, n.Status.Allocatable = room, room
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
		LastHeartbeatTime: metav1.Now(), Reason: "CageReady"}}
	if _, err := c.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	renewLease(t, c, name, time.Now())
	return s
}

// renewLease sets node's lease (6 s) as renewed at at.
func renewLease(t *testing.T, c *kube.Client, node string, at time.Time) {
	if err := setLease(c, node, at); err != nil {
		t.Fatal(err)
	}
}

func setLease(c *kube.Client, node string, at time.Time) error {
	leases := c.CoordinationV1().Leases(NodeLeaseNamespace)
	d := int32(6)
	when := metav1.NewMicroTime(at)
	l, err := leases.Get(context.Background(), node, metav1.GetOptions{})
	if kube.IsNotFound(err) {
		_, err = leases.Create(context.Background(), &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &node, LeaseDurationSeconds: &d, RenewTime: &when}}, metav1.CreateOptions{})
	} else if err == nil {
		l.Spec.RenewTime = &when
		_, err = leases.Update(context.Background(), l, metav1.UpdateOptions{})
	}
	return err
}

func writeTestJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// echoUpgrade answers a WebSocket-style upgrade and echoes what comes.
func echoUpgrade(w http.ResponseWriter, r *http.Request) {
	conn, rw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	fmt.Fprintf(rw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
	_ = rw.Flush()
	_, _ = io.Copy(conn, rw)
}

func startFront(t *testing.T, c *kube.Client, key []byte, node string) *Front {
	f := NewFront(FrontConfig{Client: c, Namespace: testNS, NodeName: node, NodeKey: key,
		LeaseDuration: 6 * time.Second, BindTimeout: 20 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := f.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return f
}

func nodeKey(t *testing.T) []byte {
	k := make([]byte, KeyLen)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// podGone waits until sandbox id's pod is deleted.
func podGone(t *testing.T, c *kube.Client, id string) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err := c.CoreV1().Pods(testNS).Get(context.Background(), id, metav1.GetOptions{})
		if kube.IsNotFound(err) {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("pod %s still there: %v", id, err)
		}
	}
}

// TestFront: creates become pods that kube-scheduler binds to a node that
// has the wall, started on that node by a signed call; a wall no node has
// and a node that refuses are clear errors that leave no pod; requests
// for a sandbox on another node are forwarded there (signed, the client's
// key kept, streams and upgrades intact), other tenants' are not; a lost
// node's sandboxes are 503s that name the node, and a kill deletes the
// pod.
func TestFront(t *testing.T) {
	c := newPlane(t)
	key := nodeKey(t)
	a := addStandIn(t, c, key, "a", "process")
	b := addStandIn(t, c, key, "b", "process")
	cn := addStandIn(t, c, key, "c", "process", "microvm")
	ctx := context.Background()
	// The lifecycle removes the not-ready taint new Nodes get (no
	// kube-controller-manager here).
	if err := CheckNodes(ctx, c, 6*time.Second, time.Now()); err != nil {
		t.Fatal(err)
	}
	f := startFront(t, c, key, "a")
	req := manager.CreateRequest{Wall: "microvm", Template: "base", KeyID: "key_000000000001", Timeout: time.Minute,
		CPUs: 1, Memory: 256 << 20, Metadata: map[string]string{"user": "x"}}

	t.Run("create lands where the wall is", func(t *testing.T) {
		for i := 0; i < 3; i++ {
			rec, err := f.Create(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if rec.AccessToken != "token-c" {
				t.Fatalf("microvm sandbox started by %q, want node c", rec.AccessToken)
			}
			p, err := c.CoreV1().Pods(testNS).Get(ctx, rec.ID, metav1.GetOptions{})
			if err != nil || p.Spec.NodeName != "c" || p.Labels[LabelKey] != req.KeyID {
				t.Fatalf("pod of %s: node %q labels %v %v", rec.ID, p.Spec.NodeName, p.Labels, err)
			}
		}
		if cn.starts.Load() != 3 || a.starts.Load()+b.starts.Load() != 0 {
			t.Fatalf("starts: a %d b %d c %d", a.starts.Load(), b.starts.Load(), cn.starts.Load())
		}
	})

	t.Run("no node has the wall", func(t *testing.T) {
		r := req
		r.Wall = "gvisor"
		_, err := f.Create(ctx, r)
		if !errors.Is(err, sandbox.ErrUnavailable) || !strings.Contains(err.Error(), "no node of the cluster can run wall gvisor") {
			t.Fatalf("create on a wall no node has: %v", err)
		}
		pods, _ := c.CoreV1().Pods(testNS).List(ctx, metav1.ListOptions{LabelSelector: LabelWall + "=gvisor"})
		if len(pods.Items) != 0 {
			t.Fatalf("%d gvisor pods left", len(pods.Items))
		}
	})

	t.Run("unknown wall", func(t *testing.T) {
		r := req
		r.Wall = "../x"
		if _, err := f.Create(ctx, r); !errors.Is(err, sandbox.ErrInvalid) || !strings.Contains(err.Error(), `unknown wall "../x"`) {
			t.Fatalf("create on an unknown wall: %v", err)
		}
	})

	t.Run("no room", func(t *testing.T) {
		r := req
		r.CPUs = 64
		_, err := f.Create(ctx, r)
		if !errors.Is(err, sandbox.ErrUnavailable) || !strings.Contains(err.Error(), "no node has room") {
			t.Fatalf("create bigger than any node: %v", err)
		}
	})

	t.Run("a refused start deletes the pod", func(t *testing.T) {
		before := podNames(t, c)
		cn.startStatus.Store(http.StatusTooManyRequests)
		defer cn.startStatus.Store(0)
		_, err := f.Create(ctx, req)
		if !errors.Is(err, manager.ErrLimit) || !strings.Contains(err.Error(), "maximum of sandboxes") {
			t.Fatalf("create refused by its node: %v", err)
		}
		if after := podNames(t, c); after != before {
			t.Fatalf("pods after a refused start: %s, before: %s", after, before)
		}
	})

	// A pod on b, owned by key_b.
	r := req
	r.Wall, r.KeyID = "process", "key_00000000000b"
	pod, err := PodFor("0000000000000000000b", r, testNS)
	if err != nil {
		t.Fatal(err)
	}
	pod.Spec.NodeName = "b"
	if _, err := c.CoreV1().Pods(testNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	id := pod.Name
	apiSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		owner := r.Header.Get("X-Test-Owner")
		if !f.Forward(w, r, strings.Split(strings.TrimPrefix(r.URL.Path, "/sandboxes/"), "/")[0], owner) {
			apiError(w, http.StatusNotFound, "local")
		}
	}))
	defer apiSrv.Close()
	call := func(method, path, owner string, hdr ...string) (int, string) {
		rq, _ := http.NewRequest(method, apiSrv.URL+path, strings.NewReader("hello"))
		rq.Header.Set("X-API-Key", "e2b_client_key")
		rq.Header.Set("X-Test-Owner", owner)
		for i := 0; i+1 < len(hdr); i += 2 {
			rq.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := http.DefaultClient.Do(rq)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	t.Run("forwarded to the owner node", func(t *testing.T) {
		code, body := call("POST", "/sandboxes/"+id+"/timeout?x=1", r.KeyID)
		want := "b POST /sandboxes/" + id + "/timeout?x=1 from=a key=e2b_client_key"
		if code != 200 || !strings.HasPrefix(body, want) || !strings.Contains(body, "for=api body=hello") {
			t.Fatalf("forwarded: %d %q, want 200 %q", code, body, want)
		}
		// Another tenant's sandbox is not forwarded: it is answered here
		// (the local manager's 404).
		if code, body := call("GET", "/sandboxes/"+id, "key_00000000000a"); code != 404 || !strings.Contains(body, "local") {
			t.Fatalf("another owner: %d %q", code, body)
		}
		// Already forwarded once: answered here, never again.
		if code, _ := call("GET", "/sandboxes/"+id, r.KeyID, AuthHeader, "node=c,t=1,sig=00"); code != 404 {
			t.Fatalf("a forwarded request was forwarded again: %d", code)
		}
		// A pod the informer has not seen yet is asked for (the caller
		// holds a key): one GET at the API server.
		before := podGets(t)
		if code, _ := call("GET", "/sandboxes/ffffffffffffffffffff", r.KeyID); code != 404 {
			t.Fatalf("unknown sandbox: %d", code)
		}
		if after := podGets(t); after != before+1 {
			t.Fatalf("an API request for an unknown sandbox made %v GETs of pods, want 1", after-before)
		}
	})

	// Attack: a key asks for sandboxes with made-up ids, each a pod the
	// informer has not seen, at its API rate. Expected: its lookups at
	// the API server (which the whole cluster shares) are at most
	// askBurst, then askRate a second; another owner's are its own.
	t.Run("an owner's lookups at the API server are bounded", func(t *testing.T) {
		const owner, calls = "key_0000000000aa", 300
		before, start := podGets(t), time.Now()
		for i := range calls {
			if code, _ := call("GET", fmt.Sprintf("/sandboxes/%020x", 1<<40+i), owner); code != 404 {
				t.Fatalf("unknown sandbox: %d", code)
			}
		}
		allowed := askBurst + askRate*time.Since(start).Seconds() + 1
		if got := podGets(t) - before; got > allowed {
			t.Fatalf("%d requests for unknown sandboxes made %v GETs of pods, want at most %.0f", calls, got, allowed)
		}
		before = podGets(t)
		if code, _ := call("GET", "/sandboxes/fffffffffffffffffffe", "key_0000000000bb"); code != 404 {
			t.Fatalf("unknown sandbox: %d", code)
		}
		if after := podGets(t); after != before+1 {
			t.Fatalf("another owner's request for an unknown sandbox made %v GETs of pods, want 1", after-before)
		}
	})

	t.Run("traffic forwarded, streams and upgrades intact", func(t *testing.T) {
		px := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !f.ForwardTraffic(w, r, r.Header.Get("E2b-Sandbox-Id")) {
				proxyError(w, "", http.StatusBadGateway, "The sandbox was not found")
			}
		}))
		defer px.Close()
		rq, _ := http.NewRequest("GET", px.URL+"/stream?stream=1", nil)
		rq.Header.Set("E2b-Sandbox-Id", id)
		rq.Host = "49983-" + id + ".cage.test"
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := http.DefaultClient.Do(rq.WithContext(ctx))
		if err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		resp.Body.Close()
		if err != nil || !strings.Contains(line, "b GET /stream?stream=1 from=a") || !strings.Contains(line, "host=49983-"+id+".cage.test for=traffic") {
			t.Fatalf("stream's first line: %q %v", line, err)
		}
		conn, err := net.Dial("tcp", strings.TrimPrefix(px.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", id)
		br := bufio.NewReader(conn)
		status, _ := br.ReadString('\n')
		if !strings.Contains(status, "101") {
			t.Fatalf("upgrade: %q", status)
		}
		for l, _ := br.ReadString('\n'); l != "\r\n" && l != ""; l, _ = br.ReadString('\n') {
		}
		fmt.Fprint(conn, "ping\n")
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		if echo, err := br.ReadString('\n'); echo != "ping\n" {
			t.Fatalf("through the upgraded connection: %q %v", echo, err)
		}
		// Ids no node holds are this proxy's to answer, and anyone may
		// send them: they cost the API server no request.
		before := podGets(t)
		for i := 0; i < 50; i++ {
			rq, _ = http.NewRequest("GET", px.URL+"/", nil)
			rq.Header.Set("E2b-Sandbox-Id", fmt.Sprintf("dead%016x", i))
			resp, err := http.DefaultClient.Do(rq)
			if err != nil || resp.StatusCode != 502 {
				t.Fatalf("unknown id: %v %v", resp, err)
			}
			resp.Body.Close()
		}
		if after := podGets(t); after != before {
			t.Fatalf("50 proxy requests for unknown ids made %v GETs of pods at the API server", after-before)
		}
	})

	t.Run("lost node", func(t *testing.T) {
		// A request in flight to b when b is lost is answered then.
		type answer struct {
			code int
			body string
		}
		hung := make(chan answer, 1)
		go func() {
			rq, _ := http.NewRequest("GET", apiSrv.URL+"/sandboxes/"+id+"?hang=1", nil)
			rq.Header.Set("X-Test-Owner", r.KeyID)
			resp, err := (&http.Client{Timeout: 15 * time.Second}).Do(rq)
			if err != nil {
				hung <- answer{0, err.Error()}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			hung <- answer{resp.StatusCode, string(b)}
		}()
		time.Sleep(300 * time.Millisecond)
		expired := time.Now().Add(-time.Minute)
		renewLease(t, c, "b", expired)
		wait(t, func() bool { l, _ := f.lost("b"); return l })
		code, body := call("GET", "/sandboxes/"+id, r.KeyID)
		at := expired.Add(6 * time.Second).UTC().Format(time.RFC3339)
		want := "sandbox " + id + " is on node b, which is lost (lease expired at " + at + ")"
		if code != 503 || !strings.Contains(body, want) {
			t.Fatalf("sandbox on a lost node: %d %q", code, body)
		}
		select {
		case a := <-hung:
			if a.code != 503 || !strings.Contains(a.body, want) {
				t.Fatalf("request in flight when the node was lost: %d %q", a.code, a.body)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a request in flight to a lost node still waits")
		}
		if code, _ := call("DELETE", "/sandboxes/"+id, r.KeyID); code != 204 {
			t.Fatalf("kill on a lost node: %d", code)
		}
		podGone(t, c, id)
	})
}

// podGets is the API server's count of GETs of single pods
// (apiserver_request_total).
func podGets(t *testing.T) float64 {
	b, err := shared.plane.Get("/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "apiserver_request_total{") && strings.Contains(line, `resource="pods"`) &&
			strings.Contains(line, `verb="GET"`) && strings.Contains(line, `scope="resource"`) {
			var v float64
			if _, err := fmt.Sscan(line[strings.LastIndex(line, " ")+1:], &v); err == nil {
				n += v
			}
		}
	}
	return n
}

// podNames lists the live sandbox pods.
func podNames(t *testing.T, c *kube.Client) string {
	pods, err := c.CoreV1().Pods(testNS).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			names = append(names, p.Name)
		}
	}
	sort.Strings(names)
	return strings.Join(names, ",")
}

func wait(t *testing.T, ok func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("condition not met in 10 s")
		}
	}
}
