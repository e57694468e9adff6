// Package clusterutil starts a cage cluster on one machine for tests and
// benchmarks: a real control plane (kubeplane: etcd, kube-apiserver,
// kube-scheduler), one network namespace per node (kubeplane.Topology),
// the cluster's RBAC, a cluster-wide API key (`cage keys create
// --kubeconfig`), and one `cage serve --kubeconfig` per node, each with its
// own data and run directories, listening on its namespace's address.
package clusterutil

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
)

// Namespace is the cluster's namespace.
const Namespace = "cage"

// NodeOptions shape one node.
type NodeOptions struct {
	Name string
	// Walls are the walls the node offers (labels cage.dev/wall-W); nil:
	// every wall the host runs.
	Walls []string
	// Config is merged into the node's config file (e.g. "pool": 2).
	Config map[string]any
}

// Options shape a cluster.
type Options struct {
	Nodes []NodeOptions
	// LeaseSeconds is each node's lease (default 6).
	LeaseSeconds int
}

// Cluster is a running cluster.
type Cluster struct {
	Plane *kubeplane.Plane
	Net   *kubeplane.Net
	Admin kubernetes.Interface
	Key   string // a cluster-wide API key (cage keys create --kubeconfig)
	Nodes map[string]*Node
	Lease time.Duration

	bin, admin string
}

// Node is one cage serve of the cluster.
type Node struct {
	Name       string
	IP         string
	API, Proxy string // http://IP:PORT
	Data       string
	RunDir     string
	Kubeconfig string
	config     string
	bin        string
	net        *kubeplane.Net

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	log  *bytes.Buffer
}

// Start starts a cluster for t (root, CAGE_KUBE_DIR); t's cleanup stops
// it. Without a control plane's binaries it skips (or fails where
// CAGE_REQUIRE_WALLS is set).
func Start(t testing.TB, o Options) *Cluster {
	t.Helper()
	testutil.RequireRoot(t)
	if _, err := kubeplane.BinDir(); err != nil {
		kubeplane.Start(t, kubeplane.Options{}) // skips or fails, saying why
	}
	if o.LeaseSeconds == 0 {
		o.LeaseSeconds = 6
	}
	var names []string
	for _, n := range o.Nodes {
		names = append(names, n.Name)
	}
	nw := kubeplane.Topology(t, names)
	p := kubeplane.Start(t, kubeplane.Options{BindIP: nw.HostIP, Nodes: names})
	admin := p.MustKubeconfig(t, kubeplane.Admin)
	rc, err := clientcmd.BuildConfigFromFlags("", admin)
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Plane: p, Net: nw, Admin: kubernetes.NewForConfigOrDie(rc), Nodes: map[string]*Node{},
		Lease: time.Duration(o.LeaseSeconds) * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kc, err := kube.LoadKubeconfig(admin)
	if err != nil {
		t.Fatal(err)
	}
	kadmin, err := kube.New(kc, kube.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := cluster.ApplyRBAC(ctx, kadmin); err != nil {
		t.Fatalf("cluster RBAC: %v", err)
	}
	bin := filepath.Join(testutil.Binaries(t), "cage")
	c.bin, c.admin = bin, admin
	c.Key = c.NewKey(t, "cluster-test")
	for _, no := range o.Nodes {
		n, err := c.newNode(t, bin, no, o.LeaseSeconds)
		if err != nil {
			t.Fatal(err)
		}
		c.Nodes[no.Name] = n
	}
	for _, no := range o.Nodes {
		n := c.Nodes[no.Name]
		t.Cleanup(func() { n.Stop(); testutil.RemoveRunDir(n.RunDir) })
		if err := n.Start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { c.endSandboxes(t) }) // first of the cleanups: the nodes still run
	return c
}

// endSandboxes ends every sandbox of the cluster, whatever state a failed
// test left it in (sandboxes outlive a cage serve, by design): every node
// runs, every sandbox pod is deleted, and the nodes destroy their
// sandboxes; what is still running 30 s later is killed here.
func (c *Cluster) endSandboxes(t testing.TB) {
	for _, n := range c.Nodes {
		n.mu.Lock()
		done := n.done
		n.mu.Unlock()
		down := done == nil
		if !down {
			select {
			case <-done:
				down = true
			default:
			}
		}
		if down {
			if err := n.Start(); err != nil {
				t.Logf("restart node %s to end its sandboxes: %v", n.Name, err)
			}
		}
		_ = c.Partition(n.Name, false)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods := c.Admin.CoreV1().Pods(Namespace)
	list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: cluster.LabelSandbox + "=true"})
	if err != nil {
		t.Logf("list sandbox pods: %v", err)
		return
	}
	zero := int64(0)
	var ids []string
	for _, p := range list.Items {
		ids = append(ids, p.Name)
		_ = pods.Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
	for _, id := range ids {
		for len(SandboxProcs(id)) > 0 && ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
		}
		if left := SandboxProcs(id); len(left) > 0 {
			t.Errorf("sandbox %s still runs 30 s after its pod was deleted (pids %v): killed", id, left)
			for _, pid := range left {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
}

// SandboxProcs are the processes in a control group named after sandbox
// id (every wall puts its processes in one).
func SandboxProcs(id string) []int {
	var pids []int
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "cgroup"))
		if err == nil && bytes.Contains(b, []byte("/"+id)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// NewKey makes a cluster-wide API key (`cage keys create --kubeconfig`).
func (c *Cluster) NewKey(t testing.TB, name string) string {
	t.Helper()
	out, err := c.Cage("keys", "create", "--name", name)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if err != nil || !strings.HasPrefix(lines[len(lines)-1], "e2b_") {
		t.Fatalf("cage keys create --kubeconfig: %v: %s", err, out)
	}
	key := lines[len(lines)-1]
	// Each node syncs the keys' Secret within a watch event: until its
	// event comes, a node answers the new key 401 (a test that used it at
	// once failed now and then on a loaded host). Wait for every node.
	for _, n := range c.Nodes {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			req, _ := http.NewRequest(http.MethodGet, n.API+"/sandboxes", nil)
			req.Header.Set("X-API-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusUnauthorized {
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %s did not take the key %s within 30 s (%v)", n.Name, name, err)
			}
		}
	}
	return key
}

// Cage runs `cage ARGS --kubeconfig ADMIN --namespace cage` (a keys or
// cluster command) and returns its standard output.
func (c *Cluster) Cage(args ...string) ([]byte, error) {
	args = append(args, "--kubeconfig", c.admin, "--namespace", Namespace)
	return cageCmd(c.bin, args...).Output()
}

func (c *Cluster) newNode(t testing.TB, bin string, o NodeOptions, lease int) (*Node, error) {
	ip := c.Net.IP(o.Name).String()
	runDir, err := os.MkdirTemp("/run", "cage-cluster-"+o.Name+"-")
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(runDir, 0o711); err != nil {
		return nil, err
	}
	n := &Node{Name: o.Name, IP: ip, Data: t.TempDir(), RunDir: runDir, bin: bin, net: c.Net,
		Kubeconfig: c.Plane.MustKubeconfig(t, o.Name), log: &bytes.Buffer{}}
	api, proxy := freePort(), freePort()
	n.API, n.Proxy = "http://"+net.JoinHostPort(ip, api), "http://"+net.JoinHostPort(ip, proxy)
	cl := map[string]any{"kubeconfig": n.Kubeconfig, "namespace": Namespace, "node_name": o.Name,
		"advertise": ip, "lease_seconds": lease}
	if o.Walls != nil {
		cl["walls"] = o.Walls
	}
	cfg := map[string]any{"api": net.JoinHostPort(ip, api), "proxy": net.JoinHostPort(ip, proxy),
		"data": n.Data, "run_dir": runDir, "cluster": cl}
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		cfg["templates"] = dir // the shared store (base, for microvm)
	}
	for k, v := range o.Config {
		cfg[k] = v
	}
	b, _ := json.MarshalIndent(cfg, "", "  ")
	n.config = filepath.Join(n.Data, "config.json")
	return n, os.WriteFile(n.config, b, 0o600)
}

// freePort picks a port nothing listens on (in the namespaces' subnet,
// nothing does but what the test starts).
func freePort() string {
	addr, err := testutil.FreeAddr("127.0.0.1")
	if err != nil {
		return "0"
	}
	_, port, _ := net.SplitHostPort(addr)
	return port
}

func cageCmd(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAGE_") || strings.HasPrefix(kv, "CAGE_RUNSC=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "CAGE_KERNEL_DIR="+testutil.KernelDir())
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// Start starts the node's cage serve in its namespace and waits for its
// /health.
func (n *Node) Start() error {
	n.mu.Lock()
	cmd := cageCmd("nsenter", "--net="+n.net.NS(n.Name), n.bin, "--debug", "--run-dir", n.RunDir,
		"serve", "--config", n.config)
	cmd.Stdout, cmd.Stderr = syncWriter{n}, syncWriter{n}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	fmt.Fprintf(n.log, "=== start %s\n", time.Now().Format(time.RFC3339Nano))
	if err := cmd.Start(); err != nil {
		n.mu.Unlock()
		return err
	}
	done := make(chan struct{})
	n.cmd, n.done = cmd, done
	n.mu.Unlock()
	go func() { _ = cmd.Wait(); close(done) }()
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get(n.API + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-done:
			return fmt.Errorf("node %s: cage serve exited before answering /health:\n%s", n.Name, n.Log())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("node %s: no /health within 60 s:\n%s", n.Name, n.Log())
		}
	}
}

// Kill9 kills the node's cage serve with SIGKILL (its sandboxes keep
// running, as after a crash) and waits for it to be gone.
func (n *Node) Kill9() {
	n.signal(syscall.SIGKILL)
}

// Stop stops the node's cage serve (SIGTERM, then SIGKILL after 20 s).
func (n *Node) Stop() {
	n.signal(syscall.SIGTERM)
}

func (n *Node) signal(sig syscall.Signal) {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	// nsenter execs cage serve: the pid is cage's.
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// Log is what the node's cage serve wrote.
func (n *Node) Log() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.log.String()
}

type syncWriter struct{ n *Node }

func (w syncWriter) Write(p []byte) (int, error) {
	w.n.mu.Lock()
	defer w.n.mu.Unlock()
	return w.n.log.Write(p)
}

// Partition cuts (or, with cut false, restores) a node's link to the
// bridge: it reaches neither the API server nor the other nodes.
func (c *Cluster) Partition(node string, cut bool) error {
	state := "up"
	if cut {
		state = "down"
	}
	out, err := exec.Command("nsenter", "--net="+c.Net.NS(node), "ip", "link", "set", "eth0", state).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip link set eth0 %s in %s: %v: %s", state, node, err, out)
	}
	if !cut { // the default route went with the link
		out, err := exec.Command("nsenter", "--net="+c.Net.NS(node), "ip", "route", "replace", "default", "via",
			c.Net.HostIP.String()).CombinedOutput()
		if err != nil {
			return fmt.Errorf("default route in %s: %v: %s", node, err, out)
		}
	}
	return nil
}
