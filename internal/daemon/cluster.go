package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// Cluster is the config file's "cluster" section: a kubeconfig turns
// cluster mode on (docs/ARCHITECTURE.md, "Cluster mode").
type Cluster struct {
	Kubeconfig   string `json:"kubeconfig"`    // also --kubeconfig, CAGE_KUBECONFIG
	Namespace    string `json:"namespace"`     // default cage
	NodeName     string `json:"node_name"`     // default the host name
	Advertise    string `json:"advertise"`     // the address others reach this node at (default: the first non-loopback IPv4)
	LeaseSeconds int    `json:"lease_seconds"` // default 40
	// CPUOvercommit and MemoryOvercommit multiply the host's CPUs and
	// memory into what the Node offers (defaults 32 and 16: a sandbox's
	// limits are ceilings, not reservations).
	CPUOvercommit    float64 `json:"cpu_overcommit"`
	MemoryOvercommit float64 `json:"memory_overcommit"`
	// Walls this node offers the cluster (labels cage.dev/wall-W); default:
	// every wall the host can run.
	Walls []string `json:"walls"`
}

// config is the cluster package's Config for listeners at api and proxy.
func (c Cluster) config(api, proxy net.Addr) (cluster.Config, error) {
	if c.LeaseSeconds < 0 {
		return cluster.Config{}, fmt.Errorf("cluster.lease_seconds: negative")
	}
	cc := cluster.Config{Kubeconfig: c.Kubeconfig, Namespace: c.Namespace, NodeName: c.NodeName,
		Advertise: c.Advertise, LeaseDuration: time.Duration(c.LeaseSeconds) * time.Second,
		CPUOvercommit: c.CPUOvercommit, MemoryOvercommit: c.MemoryOvercommit,
		APIPort: api.(*net.TCPAddr).Port, ProxyPort: proxy.(*net.TCPAddr).Port}
	if cc.Advertise == "" {
		// A listener on one address is reached there.
		if ip := api.(*net.TCPAddr).IP; ip != nil && !ip.IsUnspecified() && !ip.IsLoopback() {
			cc.Advertise = ip.String()
		}
	}
	if err := cc.Defaults(); err != nil {
		return cc, err
	}
	// Other nodes and the API server's users reach both listeners at the
	// advertised address: one bound elsewhere would make a node nobody
	// can reach.
	adv := net.ParseIP(cc.Advertise)
	for _, l := range []struct {
		name string
		addr net.Addr
	}{{"--api", api}, {"--proxy", proxy}} {
		if ip := l.addr.(*net.TCPAddr).IP; !ip.IsUnspecified() && !ip.Equal(adv) {
			return cc, fmt.Errorf("cluster: %s listens on %s, but other nodes reach this node at %s (cluster.advertise): listen there or on 0.0.0.0",
				l.name, l.addr, cc.Advertise)
		}
	}
	return cc, nil
}

// changeHook passes the manager's changes to the node once there is one.
type changeHook struct{ n atomic.Pointer[cluster.Node] }

func (h *changeHook) changed(id, kind string) {
	if n := h.n.Load(); n != nil {
		n.Changed(id, kind)
	}
}

// clusterParts are what cluster mode adds to the daemon.
type clusterParts struct {
	node  *cluster.Node
	front *cluster.Front
}

// startCluster joins the cluster as a node and starts the front; nil when
// cluster mode is off.
func startCluster(ctx context.Context, cfg Config, hook *changeHook, mgr *manager.Manager, host *sandbox.Host,
	st *store.Store, apiAddr, proxyAddr net.Addr, perClient int, log *slog.Logger) (*clusterParts, error) {
	if cfg.Cluster.Kubeconfig == "" {
		return nil, nil
	}
	cc, err := cfg.Cluster.config(apiAddr, proxyAddr)
	if err != nil {
		return nil, err
	}
	walls, err := clusterWalls(cfg.Cluster.Walls, host)
	if err != nil {
		return nil, err
	}
	node, err := cluster.NewNode(cluster.NodeConfig{Config: cc, Manager: mgr, Host: host, Log: log,
		Version: api.EnvdVersion, MaxSandboxes: cfg.MaxSandboxes, Walls: walls})
	if err != nil {
		return nil, err
	}
	hook.n.Store(node)
	if err := cluster.SyncKeys(ctx, node.Client(), cc.Namespace, st, log); err != nil {
		return nil, err
	}
	if err := node.Start(ctx); err != nil {
		return nil, err
	}
	front := cluster.NewFront(cluster.FrontConfig{Client: node.Client(), Namespace: cc.Namespace, NodeName: cc.NodeName,
		NodeKey: node.Key(), LeaseDuration: cc.LeaseDuration, PerClient: perClient, Log: log})
	if err := front.Start(ctx); err != nil { // ctx: the informers run as long as it does
		return nil, err
	}
	go cluster.RunLifecycle(ctx, node.Client(), cc.Namespace, cc.NodeName, cc.LeaseDuration, log)
	return &clusterParts{node: node, front: front}, nil
}

// clusterWalls are the walls this node offers: those asked for (each must
// be one the host runs), or every one it runs.
func clusterWalls(asked []string, host *sandbox.Host) ([]string, error) {
	var walls []string
	for _, w := range sandbox.Walls {
		if host.WallMissing(w) == nil && (len(asked) == 0 || slices.Contains(asked, w)) {
			walls = append(walls, w)
		}
	}
	for _, w := range asked {
		if !slices.Contains(walls, w) {
			return nil, fmt.Errorf("cluster.walls: %q is not a wall this host runs", w)
		}
	}
	return walls, nil
}

// routes serves the node's internal routes before h.
func (p *clusterParts) routes(h http.Handler) http.Handler {
	if p == nil {
		return h
	}
	return p.node.Routes(h)
}

// api is the front for api.Config.Cluster (nil off cluster mode).
func (p *clusterParts) api() api.Cluster {
	if p == nil {
		return nil
	}
	return p.front
}

// forward is the proxy's Forward (nil off cluster mode).
func (p *clusterParts) forward() func(w http.ResponseWriter, r *http.Request, id string) bool {
	if p == nil {
		return nil
	}
	return p.front.ForwardTraffic
}

// trafficClient is the proxy's Client (nil off cluster mode).
func (p *clusterParts) trafficClient() func(r *http.Request) string {
	if p == nil {
		return nil
	}
	return p.front.TrafficClient
}
