package kubeplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cagehq/cage/internal/testutil"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

// TestPlane starts the plane on a Topology's bridge and checks what the
// cluster tests rely on: the scheduler binds a pod to the node its selector
// names, a node's token gets only what RBAC grants it (nothing here: 403),
// the namespaces exist, the node namespaces reach the apiserver and each
// other, and Stop leaves no process of the plane.
func TestPlane(t *testing.T) {
	nw := Topology(t, []string{"a", "b"})
	p := Start(t, Options{BindIP: nw.HostIP, Nodes: []string{"a", "b"}})
	admin := clientFor(t, p, Admin)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	for _, ns := range []string{"default", "kube-system", "kube-node-lease"} {
		if _, err := admin.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err != nil {
			t.Errorf("namespace %s: %v", ns, err)
		}
	}
	for _, n := range []string{"a", "b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, testNode(n), metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", n, err)
		}
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p1", Namespace: "default"},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"kubeplane.test/name": "b"},
			Containers: []corev1.Container{{Name: "c", Image: "cage.dev/template/base",
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("512Mi")}}}},
		},
	}
	if _, err := admin.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod: %v", err)
	}
	var bound string
	wait, stop := context.WithTimeout(ctx, 30*time.Second)
	defer stop()
	for bound == "" && wait.Err() == nil {
		got, err := admin.CoreV1().Pods("default").Get(wait, "p1", metav1.GetOptions{})
		if err == nil {
			bound = got.Spec.NodeName
		}
		time.Sleep(100 * time.Millisecond)
	}
	if bound != "b" {
		got, _ := admin.CoreV1().Pods("default").Get(context.Background(), "p1", metav1.GetOptions{})
		t.Fatalf("the scheduler bound p1 to %q, want b (its nodeSelector); conditions %+v", bound, got.Status.Conditions)
	}

	// A node's token authenticates (its user is who it says) but RBAC grants
	// it nothing here: the cluster package's ApplyRBAC does that.
	node := clientFor(t, p, "a")
	if _, err := node.CoreV1().Pods("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node a lists pods: %v, want 403 Forbidden", err)
	} else if !strings.Contains(err.Error(), NodeUser("a")) {
		t.Errorf("the 403 does not name the node's user: %v", err)
	}
	if err := node.CoreV1().Nodes().Delete(ctx, "b", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node a deletes node b: %v, want 403 Forbidden", err)
	}
	bad := *p
	bad.tokens = map[string]string{Admin: "not-a-token"}
	if code, _, err := bad.do(http.MethodGet, "/api/v1/namespaces", nil); err != nil || code != http.StatusUnauthorized {
		t.Errorf("a wrong token: %d %v, want 401", code, err)
	}

	checkReach(t, p, nw)

	pids := p.PIDs()
	if len(pids) != 3 {
		t.Fatalf("plane processes running: %v, want etcd, kube-apiserver, kube-scheduler", pids)
	}
	p.Stop()
	if left := inGroups(pids); len(left) > 0 {
		t.Errorf("after Stop, processes of the plane still run: %v", left)
	}
}

// checkReach: from node a's namespace, the apiserver answers /readyz to a's
// token; a listener in b's namespace is reached from a's.
func checkReach(t *testing.T, p *Plane, nw *Net) {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(p.caPEM)
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool},
		DialContext: func(_ context.Context, _, addr string) (net.Conn, error) {
			var c net.Conn
			var err error
			inNS(t, nw.NS("a"), func() { c, err = net.DialTimeout("tcp", addr, 10*time.Second) })
			return c, err
		}}}
	req, _ := http.NewRequest(http.MethodGet, p.URL+"/readyz", nil)
	req.Header.Set("Authorization", "Bearer "+p.Token("a"))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("readyz from node a's namespace: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("readyz from node a's namespace as node a: %d %s", resp.StatusCode, body)
	}

	l := listenIn(t, nw.NS("b"), net.JoinHostPort(nw.IP("b").String(), "0"))
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			_, _ = c.Write([]byte("from b"))
			c.Close()
		}
	}()
	c := dialIn(t, nw.NS("a"), l.Addr().String())
	defer c.Close()
	got, _ := io.ReadAll(c)
	if string(got) != "from b" {
		t.Errorf("a reached b's listener and read %q", got)
	}
}

// inNS runs f on a thread in the network namespace at path; the thread is
// thrown away after (its goroutine exits locked).
func inNS(t *testing.T, path string, f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		h, err := netns.GetFromPath(path)
		if err != nil {
			t.Error(err)
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			t.Error(err)
			return
		}
		f()
	}()
	<-done
}

func dialIn(t *testing.T, ns, addr string) net.Conn {
	var c net.Conn
	var err error
	inNS(t, ns, func() { c, err = net.DialTimeout("tcp", addr, 10*time.Second) })
	if err != nil {
		t.Fatalf("dial %s from %s: %v", addr, ns, err)
	}
	return c
}

func listenIn(t *testing.T, ns, addr string) net.Listener {
	var l net.Listener
	var err error
	inNS(t, ns, func() { l, err = net.Listen("tcp", addr) })
	if err != nil {
		t.Fatalf("listen %s in %s: %v", addr, ns, err)
	}
	return l
}

// inGroups returns the processes whose process group is one of pgids.
func inGroups(pgids []int) []string {
	want := map[string]bool{}
	for _, p := range pgids {
		want[strconv.Itoa(p)] = true
	}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var left []string
	for _, s := range stats {
		data, err := os.ReadFile(s)
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...: fields after the last ')'.
		i := strings.LastIndexByte(string(data), ')')
		f := strings.Fields(string(data)[i+1:])
		if len(f) > 2 && want[f[2]] {
			left = append(left, string(data[:i+1]))
		}
	}
	return left
}

func clientFor(t *testing.T, p *Plane, user string) *kubernetes.Clientset {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", p.MustKubeconfig(t, user))
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func testNode(name string) *corev1.Node {
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"),
		corev1.ResourceMemory: resource.MustParse("8Gi"), corev1.ResourcePods: resource.MustParse("10")}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubeplane.test/name": name}},
		Status: corev1.NodeStatus{Capacity: res, Allocatable: res,
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
				LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}},
	}
}

// TestBinDir: without CAGE_KUBE_DIR, or with a directory that lacks a
// binary, BinDir says what is missing (and Start skips or fails on it).
func TestBinDir(t *testing.T) {
	t.Setenv(EnvDir, "")
	if _, err := BinDir(); err == nil || !strings.Contains(err.Error(), "not set") {
		t.Errorf("unset: %v", err)
	}
	dir := t.TempDir()
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv(EnvDir, dir)
	if _, err := BinDir(); err == nil || !strings.Contains(err.Error(), "kube-scheduler") {
		t.Errorf("no kube-scheduler: %v", err)
	}
}

// TestStartWithoutBinaries: without the binaries Start skips the test, and
// fails it where CAGE_REQUIRE_WALLS says every part of the suite must run
// (CI as root). Each case runs in a child test process.
func TestStartWithoutBinaries(t *testing.T) {
	if os.Getenv("KUBEPLANE_CHILD") == "1" {
		Start(t, Options{})
		t.Log("KUBEPLANE-STARTED")
		return
	}
	for _, c := range []struct {
		require, want string
		fails         bool
	}{{"", "--- SKIP", false}, {"process", "are required here (CAGE_REQUIRE_WALLS)", true}} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestStartWithoutBinaries$", "-test.v")
		cmd.Env = append(os.Environ(), "KUBEPLANE_CHILD=1", EnvDir+"=", "CAGE_REQUIRE_WALLS="+c.require)
		out, err := cmd.CombinedOutput()
		if (err != nil) != c.fails || !strings.Contains(string(out), c.want) || strings.Contains(string(out), "KUBEPLANE-STARTED") {
			t.Errorf("CAGE_REQUIRE_WALLS=%q: err %v, want failure %v and %q:\n%s", c.require, err, c.fails, c.want, out)
		}
	}
}
