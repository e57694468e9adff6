package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// The cluster's figures (issue 21; docs/SCALE.md), against agent-sandbox's
// published targets and one cage serve measured in the same run.
const (
	clusterConns  = 24               // clients at once in the claim-rate window
	clusterWindow = 10 * time.Second // the claim-rate window
	clusterIdle   = 20 * time.Second // the API server's idle traffic is measured this long
	// clusterWatchers stand for more fronts in the fan-out measurement.
	clusterWatchers = 200
)

var clusterRows = []bench.Row{
	{ID: "cluster.tti", What: "claim -> first output through node a's front, one at a time (3 nodes, pools of 4)",
		PeerName: "one cage serve, pool of 4 (same run)", Target: "p50 <= 200 ms (agent-sandbox: 50-200 ms)"},
	{ID: "cluster.rate", What: fmt.Sprintf("claims/s, %d clients over the 3 fronts for %s (sandboxes kept)", clusterConns, clusterWindow),
		PeerName: "one cage serve, same clients (same run)", Target: ">= 300/s (agent-sandbox burst)"},
	{ID: "cluster.apireq", What: "API server requests per claim (create, connect, echo, kill; idle traffic taken out)"},
	{ID: "cluster.fanout", What: fmt.Sprintf("API server CPU per claim with %d more pod watchers (a front's informer each)", clusterWatchers),
		PeerName: "the three nodes' watchers only"},
	{ID: "cluster.pod", What: "a sandbox pod's size in etcd (protobuf)"},
}

func init() { expectedRows["cluster"] = clusterRows }

// clusterNetnsEnv marks the bench process that runs in a network
// namespace of its own.
const clusterNetnsEnv = "CAGE_BENCH_CLUSTER_NETNS"

// benchCluster runs the cluster bench in a network namespace of its own (a
// child `cage bench --only cluster --json`, whose rows it takes): the
// nodes' bridge there meets no host firewall (bridged packets pass the
// host's forward hooks where bridge-nf-call-iptables is on, and a cage
// daemon's table drops them), and goes with it.
func benchCluster(ctx context.Context, t *bench.Table, g *globals, runs int) error {
	if os.Getenv(clusterNetnsEnv) == "1" {
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			return fmt.Errorf("loopback: %v: %s", err, out)
		}
		return benchClusterHere(ctx, t, runs)
	}
	if os.Geteuid() != 0 {
		for _, r := range clusterRows {
			t.Skip(r.ID, "", "a cluster needs root (network namespaces)")
		}
		return nil
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, exe, "--run-dir", g.runDir+"-cluster", "bench", "--only", "cluster", "--json",
		"--runs", strconv.Itoa(runs))
	cmd.Env = append(os.Environ(), clusterNetnsEnv+"=1")
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.Output() // exit 125 when a row failed: its rows say why
	var res struct{ Rows []bench.Row }
	if jerr := json.Unmarshal(out, &res); jerr != nil || len(res.Rows) == 0 {
		return fmt.Errorf("the cluster bench in its own network namespace: %v (%v)", err, jerr)
	}
	for _, r := range res.Rows {
		t.Set(r)
	}
	return nil
}

// benchClusterHere starts a cluster of three nodes on this machine (root
// and $CAGE_KUBE_DIR), measures through it, stops it, then measures one
// cage serve the same way.
func benchClusterHere(ctx context.Context, t *bench.Table, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	limits := map[string]any{"key_requests": 1e6, "key_creates": 1e6}
	// Room for the claim-rate window's sandboxes: a node offers its CPUs
	// times cpu_overcommit (default 32) to the scheduler.
	c, err := bench.StartCluster(exe, []string{"a", "b", "c"}, map[string]any{"pool": 4, "pool_template": "host",
		"limits": limits, "max_sandboxes": 4000, "cluster": map[string]any{"cpu_overcommit": 1000, "memory_overcommit": 1000}})
	if err != nil {
		for _, r := range clusterRows {
			t.Skip(r.ID, "", "no cluster: "+err.Error())
		}
		return nil
	}
	tti, burst, cerr := measureCluster(ctx, t, c, runs)
	c.Stop()
	if cerr != nil {
		return cerr
	}
	// One cage serve, the same way, after the cluster is gone.
	dir, err := os.MkdirTemp("", "cage-bench-single-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg, _ := json.Marshal(map[string]any{"limits": limits})
	path := filepath.Join(dir, "cage.json")
	if err := os.WriteFile(path, cfg, 0o600); err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 4, "--config", path, "--max-sandboxes", "4000")
	if err != nil {
		return err
	}
	defer d.Stop()
	if r, _ := t.Get("cluster.tti"); r.Status != bench.Failed && tti.N > 0 {
		one, err := bench.TimeToInteractive(ctx, d.Client(), runs, 1)
		if err != nil {
			return err
		}
		r.Peer, r.Ratio = bench.Latency(one), stats.Ratio(tti, one)
		t.Set(r)
	}
	b1 := bench.Sustained(ctx, []*client.Client{d.Client()}, clusterConns, clusterWindow)
	bench.KillAll(d.Client())
	if r, _ := t.Get("cluster.rate"); b1.Creates > 0 && burst.Creates > 0 && r.Status != bench.Failed {
		r.Peer, r.Ratio = bench.Quantity(b1.Rate, "creates/s"), burst.Rate/b1.Rate
		t.Set(r)
	}
	return nil
}

// measureCluster fills cluster.tti and cluster.rate (but their peers),
// cluster.apireq and cluster.pod.
func measureCluster(ctx context.Context, t *bench.Table, c *bench.Cluster, runs int) (stats.Stats, bench.Burst, error) {
	var tti stats.Stats
	var burst bench.Burst
	idle0, err := c.Counts()
	if err != nil {
		return tti, burst, err
	}
	time.Sleep(clusterIdle)
	idle1, err := c.Counts()
	if err != nil {
		return tti, burst, err
	}
	idle := bench.Delta(idle0, idle1, nil, 0)
	place, err := c.WatchPlacement(ctx)
	if err != nil {
		return tti, burst, err
	}
	before, err := c.Counts()
	if err != nil {
		return tti, burst, err
	}
	from := time.Now()
	tti, err = bench.TimeToInteractive(ctx, c.Client(0), runs, 1)
	to := time.Now()
	after, cerr := c.Counts()
	where, mine := place.Stop()
	if err != nil {
		t.Fail("cluster.tti", "", err)
	} else {
		t.Set(bench.Row{ID: "cluster.tti", Cage: bench.Latency(tti), Status: bench.Judge(tti.P50 <= 200*time.Millisecond),
			Note: "landed: " + where + "; node a, b, c and the control plane share this machine"})
	}
	if err == nil && cerr == nil {
		claims := float64(runs + 3) // TimeToInteractive's three warm-up claims count too
		d := bench.Delta(before, after, &idle, idle1.At.Sub(idle0.At))
		d.PodEvents -= float64(mine) // the bench's own watch
		note := fmt.Sprintf("%s; pod watch events sent %.1f, etcd revisions %.1f per claim; idle: %.2f requests/s",
			d.Top(6, claims), d.PodEvents/claims, d.Revisions/claims, idle.Total/idle1.At.Sub(idle0.At).Seconds())
		if who, err := c.ByClient(from, to); err == nil {
			note += "; by client (audit log, idle not taken out): " + bench.TopOf(who, 10, claims)
		}
		t.Set(bench.Row{ID: "cluster.apireq", Cage: bench.Quantity(d.Total/claims, "requests"), Status: bench.NoTarget, Note: note})
	}
	fanout(ctx, t, c, runs)
	clients := []*client.Client{c.Client(0), c.Client(1), c.Client(2)}
	burst = bench.Sustained(ctx, clients, clusterConns, clusterWindow)
	note := fmt.Sprintf("%d claims, %d errors; overcommit 1000 so that capacity does not stop them", burst.Creates, burst.Errors)
	if burst.FirstErr != nil {
		note += " (first: " + firstLineOf(burst.FirstErr.Error()) + ")"
	}
	if burst.Creates == 0 {
		t.Set(bench.Row{ID: "cluster.rate", Status: bench.Failed, Note: note})
	} else {
		t.Set(bench.Row{ID: "cluster.rate", Cage: bench.Quantity(burst.Rate, "claims/s"), Status: bench.Judge(burst.Rate >= 300), Note: note})
	}
	podSize(t, c, before)
	bench.KillAll(c.Client(0))
	return tti, burst, nil
}

// podSize reads one sandbox pod as etcd keeps it (protobuf) and as JSON,
// and etcd's growth in use per sandbox alive since before.
func podSize(t *bench.Table, c *bench.Cluster, before bench.APICounts) {
	pods, err := c.Admin.CoreV1().Pods(bench.ClusterNamespace).List(context.Background(), metav1.ListOptions{})
	if err != nil || len(pods.Items) == 0 {
		t.Skip("cluster.pod", "", fmt.Sprintf("no sandbox pod to read (%v)", err))
		return
	}
	// A running sandbox's pod (one being deleted may be gone by the read).
	var pb, js []byte
	for _, pod := range pods.Items {
		if pod.DeletionTimestamp != nil || pod.Status.Phase != "Running" {
			continue
		}
		path := "/api/v1/namespaces/" + bench.ClusterNamespace + "/pods/" + pod.Name
		if pb, err = c.Plane.Get(path, "application/vnd.kubernetes.protobuf"); err == nil {
			if js, err = c.Plane.Get(path); err == nil {
				break
			}
		}
	}
	if err != nil || len(pb) == 0 {
		t.Fail("cluster.pod", "", fmt.Errorf("no running sandbox pod could be read (%v)", err))
		return
	}
	now, _ := c.Counts()
	growth := "n/a"
	if before.EtcdDBInUse > 0 && now.EtcdDBInUse > before.EtcdDBInUse {
		growth = strconv.FormatFloat((now.EtcdDBInUse-before.EtcdDBInUse)/float64(len(pods.Items))/1024, 'f', 1, 64) + " KiB"
	}
	t.Set(bench.Row{ID: "cluster.pod", Cage: bench.Quantity(float64(len(pb)), "bytes"), Status: bench.NoTarget,
		Note: fmt.Sprintf("JSON %d bytes; etcd in use grew %s per sandbox with %d alive (history not compacted)", len(js), growth, len(pods.Items))})
}

func firstLineOf(s string) string {
	for i, r := range s {
		if r == '\n' {
			return s[:i]
		}
	}
	return s
}

// fanout measures what pod watchers cost the API server: its CPU time and
// the pod events it sends per claim (one at a time through node a), with
// the cluster's own watchers and with clusterWatchers more, as that many
// more fronts would add. The difference per event sent is what a front's
// pod informer costs per pod change.
func fanout(ctx context.Context, t *bench.Table, c *bench.Cluster, runs int) {
	pid := c.Plane.PID("kube-apiserver")
	claims := float64(runs + 3)
	phase := func(extra int) (cpu time.Duration, events float64, err error) {
		if extra > 0 {
			stop, err := c.Watchers(ctx, extra)
			if err != nil {
				return 0, 0, err
			}
			defer stop()
			time.Sleep(time.Second)
		}
		before, err := c.Counts()
		if err != nil {
			return 0, 0, err
		}
		cpu0, err := bench.CPUTime(pid)
		if err != nil {
			return 0, 0, err
		}
		if _, err := bench.TimeToInteractive(ctx, c.Client(0), runs, 1); err != nil {
			return 0, 0, err
		}
		cpu1, err := bench.CPUTime(pid)
		if err != nil {
			return 0, 0, err
		}
		after, err := c.Counts()
		return (cpu1 - cpu0) / time.Duration(claims), (after.PodEvents - before.PodEvents) / claims, err
	}
	cpu0, ev0, err := phase(0)
	if err != nil {
		t.Fail("cluster.fanout", "", err)
		return
	}
	cpu1, ev1, err := phase(clusterWatchers)
	if err != nil {
		t.Fail("cluster.fanout", "", err)
		return
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	note := fmt.Sprintf("pod events sent per claim %.0f -> %.0f", ev0, ev1)
	if ev1 > ev0 && cpu1 > cpu0 {
		per := (cpu1 - cpu0) / time.Duration(ev1-ev0)
		// 1,000 fronts at 300 claims/s: (ev1-ev0)/clusterWatchers events per claim per watcher.
		cores := 300 * 1000 * (ev1 - ev0) / clusterWatchers * per.Seconds()
		note += fmt.Sprintf("; %.1f us of API server CPU per event sent; 1,000 fronts at 300 claims/s: about %.0f cores", float64(per.Nanoseconds())/1000, cores)
	}
	ratio := 0.0
	if cpu0 > 0 {
		ratio = float64(cpu1) / float64(cpu0)
	}
	t.Set(bench.Row{ID: "cluster.fanout", Cage: bench.Quantity(ms(cpu1), "ms CPU"), Peer: bench.Quantity(ms(cpu0), "ms CPU"),
		Ratio: ratio, Status: bench.NoTarget, Note: note + " (CPU ticks of 10 ms, the idle share included)"})
}
