package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/freeport"
	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
)

// A cage cluster on this machine for `cage bench --only cluster`, made as
// test/cluster's clusterutil makes one for the tests (that one needs a
// testing.TB and builds the binaries; this one runs the bench's own
// executable): the control plane (kubeplane: etcd with fsync, as in
// production; kube-apiserver; kube-scheduler) on a bridge, one network
// namespace per node, the nodes' RBAC, a cluster-wide key, and one
// `cage serve --config` per node listening on its namespace's address.

// ClusterNamespace is the bench cluster's namespace.
const ClusterNamespace = "cage"

// Cluster is a running bench cluster.
type Cluster struct {
	Plane *kubeplane.Plane
	Net   *kubeplane.Net
	Admin *kube.Client
	Key   string
	Nodes []*ClusterNode
	dir   string
}

// ClusterNode is one node's cage serve.
type ClusterNode struct {
	Name, API, Proxy string
	cmd              *exec.Cmd
	done             chan struct{}
	run              string
	log              *os.File
}

// StartCluster starts a cluster of the named nodes, each `cage serve` with
// config merged into its config file (a pool, limits; a "cluster" map is
// merged into the cluster section).
func StartCluster(exe string, names []string, config map[string]any) (c *Cluster, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("a cluster needs root (network namespaces)")
	}
	if _, err := kubeplane.BinDir(); err != nil {
		return nil, fmt.Errorf("no control plane: %w (scripts/kube.sh DIR builds one; set %s=DIR)", err, kubeplane.EnvDir)
	}
	c = &Cluster{}
	if c.dir, err = os.MkdirTemp("", "cage-bench-cluster-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	if c.Net, err = kubeplane.NewNet(names); err != nil {
		return nil, err
	}
	c.Plane, err = kubeplane.Launch(kubeplane.Options{BindIP: c.Net.HostIP, Nodes: names,
		Dir: filepath.Join(c.dir, "plane"), Fsync: true, Audit: true})
	if err != nil {
		return nil, err
	}
	admin, err := c.Plane.Kubeconfig(kubeplane.Admin)
	if err != nil {
		return nil, err
	}
	kc, err := kube.LoadKubeconfig(admin)
	if err != nil {
		return nil, err
	}
	if c.Admin, err = kube.New(kc, kube.Options{QPS: 500, Burst: 1000}); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cluster.ApplyRBAC(ctx, c.Admin, ClusterNamespace); err != nil {
		return nil, err
	}
	out, err := nodeCmd(exe, "keys", "create", "--kubeconfig", admin, "--namespace", ClusterNamespace, "--name", "bench").Output()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if err != nil || !strings.HasPrefix(lines[len(lines)-1], "e2b_") {
		return nil, fmt.Errorf("cage keys create --kubeconfig: %v: %s", err, out)
	}
	c.Key = lines[len(lines)-1]
	for _, name := range names {
		n, err := c.startNode(exe, name, config)
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, n)
	}
	return c, nil
}

func (c *Cluster) startNode(exe, name string, extra map[string]any) (*ClusterNode, error) {
	ip := c.Net.IP(name).String()
	data := filepath.Join(c.dir, "node-"+name)
	run, err := os.MkdirTemp("/run", "cage-bench-cluster-"+name+"-")
	if err != nil {
		return nil, err
	}
	_ = os.Chmod(run, 0o711)
	n := &ClusterNode{Name: name, run: run, done: make(chan struct{})}
	kc, err := c.Plane.Kubeconfig(name)
	if err != nil {
		return nil, err
	}
	api, proxy := net.JoinHostPort(ip, freePortOn(ip)), net.JoinHostPort(ip, freePortOn(ip))
	n.API, n.Proxy = "http://"+api, "http://"+proxy
	cl := map[string]any{"kubeconfig": kc, "namespace": ClusterNamespace, "node_name": name, "advertise": ip}
	cfg := map[string]any{"api": api, "proxy": proxy, "data": data, "run_dir": run, "cluster": cl}
	for k, v := range extra {
		if more, ok := v.(map[string]any); ok && k == "cluster" {
			for ck, cv := range more {
				cl[ck] = cv
			}
			continue
		}
		cfg[k] = v
	}
	if err := os.MkdirAll(data, 0o700); err != nil {
		return nil, err
	}
	b, _ := json.MarshalIndent(cfg, "", "  ")
	path := filepath.Join(data, "config.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return nil, err
	}
	if n.log, err = os.Create(filepath.Join(c.dir, "node-"+name+".log")); err != nil {
		return nil, err
	}
	n.cmd = nodeCmd("nsenter", "--net="+c.Net.NS(name), exe, "--run-dir", run, "serve", "--config", path)
	n.cmd.Stdout, n.cmd.Stderr = n.log, n.log
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := kubeplane.StartProcess(n.cmd); err != nil { // Pdeathsig: from a thread that stays
		return nil, err
	}
	go func() { _ = n.cmd.Wait(); close(n.done) }()
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get(n.API + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return n, nil
			}
		}
		select {
		case <-n.done:
			return nil, fmt.Errorf("node %s: cage serve exited (its log: %s)", name, n.log.Name())
		default:
		}
		if time.Now().After(deadline) {
			n.stop()
			return nil, fmt.Errorf("node %s: no /health within 60 s (its log: %s)", name, n.log.Name())
		}
	}
}

// Client is a client of the cluster's front on node i.
func (c *Cluster) Client(i int) *client.Client {
	n := c.Nodes[i%len(c.Nodes)]
	return client.New(n.API, n.Proxy, c.Key)
}

// Stop kills the sandboxes left, stops the nodes, the plane and the
// network, and removes their files (the nodes' logs are kept when a node
// logged an error, and named).
func (c *Cluster) Stop() {
	if len(c.Nodes) > 0 {
		killAll(c.Client(0))
	}
	for _, n := range c.Nodes {
		n.stop()
	}
	if c.Plane != nil {
		c.Plane.Stop()
	}
	if c.Net != nil {
		c.Net.Remove()
	}
	kept := false
	for _, n := range c.Nodes {
		if b, err := os.ReadFile(n.log.Name()); err == nil && strings.Contains(string(b), "level=ERROR") {
			fmt.Fprintf(os.Stderr, "cage bench: node %s logged errors: %s\n", n.Name, n.log.Name())
			kept = true
		}
	}
	if !kept && c.dir != "" {
		os.RemoveAll(c.dir)
	}
}

func (n *ClusterNode) stop() {
	if n.cmd != nil && n.cmd.Process != nil {
		_ = n.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-n.done:
		case <-time.After(30 * time.Second):
			_ = n.cmd.Process.Kill()
			<-n.done
		}
	}
	if n.log != nil {
		n.log.Close()
	}
	unmountUnder(n.run)
	os.RemoveAll(n.run)
}

// killAll kills every sandbox the client's key has, 8 at a time.
func killAll(c *client.Client) {
	list, err := c.List(context.Background(), nil)
	if err != nil {
		return
	}
	ids := make(chan string)
	done := make(chan struct{})
	for w := 0; w < 8; w++ {
		go func() {
			for id := range ids {
				_ = c.Kill(context.Background(), id)
			}
			done <- struct{}{}
		}()
	}
	for _, s := range list {
		ids <- s.SandboxID
	}
	close(ids)
	for w := 0; w < 8; w++ {
		<-done
	}
}

// nodeCmd runs a cage command with the caller's environment less what
// would point it elsewhere (CAGE_* but the runtimes' and templates').
func nodeCmd(path string, args ...string) *exec.Cmd {
	cmd := exec.Command(path, args...)
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(k, "CAGE_") || k == "CAGE_RUNSC" || k == "CAGE_KERNEL_DIR" || k == "CAGE_TEMPLATES" {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	return cmd
}

// freePortOn picks a port free on ip now.
func freePortOn(ip string) string {
	addr, err := freeport.Addr(ip)
	if err != nil {
		if addr, err = freeport.Addr("127.0.0.1"); err != nil {
			return "0"
		}
	}
	_, port, _ := net.SplitHostPort(addr)
	return port
}
