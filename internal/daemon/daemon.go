// Package daemon runs `cage serve`: the store, the sandbox manager, the
// E2B-compatible control API and the sandbox-traffic proxy, wired together
// and stopped cleanly. Sandboxes outlive the daemon: a restart adopts them.
package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/metrics"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/proxy"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/units"
)

// Config is the daemon's configuration. JSON field names are those of the
// config file.
type Config struct {
	API             string   `json:"api"`     // control API address
	Proxy           string   `json:"proxy"`   // sandbox traffic address
	Data            string   `json:"data"`    // state directory (SQLite database)
	RunDir          string   `json:"run_dir"` // runtime state of sandboxes
	Domain          string   `json:"domain"`  // for {port}-{id}.{domain} hosts
	DefaultTemplate string   `json:"default_template"`
	Templates       string   `json:"templates"`    // the template store (default DATA/templates)
	DefaultWall     string   `json:"default_wall"` // process, runc or gvisor
	MaxTimeout      Duration `json:"max_timeout"`
	// PausedRetention is how long a paused sandbox is kept (default 30
	// days, as E2B), after which it is deleted.
	PausedRetention Duration `json:"paused_retention"`
	MaxSandboxes    int      `json:"max_sandboxes"`
	Pool            int      `json:"pool"` // prepared sandboxes kept ready
	// PoolTemplate is the template the pool prepares (default: the
	// default template; E2B's SDKs ask for "base" when given none).
	PoolTemplate string `json:"pool_template"`
	// PoolGrow lets every pool keep up to PoolGrow times its size while
	// creates find it empty (a burst), shrinking back after a minute
	// without creates; 1 keeps each pool at its size.
	PoolGrow int `json:"pool_grow"`
	// Pools keeps sandboxes of more templates ready: template name (on
	// the default wall) or WALL/TEMPLATE -> how many. A template with a
	// start command (code-interpreter-v1) is kept started, its command run
	// and ready. The pool of Pool is on the default wall.
	Pools     map[string]int `json:"pools"`
	AgentPath string         `json:"agent"`
	Network   Network        `json:"network"`
	Limits    Limits         `json:"limits"`
	Records   Records        `json:"records"`
	Audit     Audit          `json:"audit"`
	Volumes   Volumes        `json:"volumes"`
	Dify      Dify           `json:"dify"`
	Metrics   Metrics        `json:"metrics"`
	UI        UI             `json:"ui"` // the dashboard at /ui (ui.go)
	// TLS makes the proxy's listener speak TLS (tls.go).
	TLS TLS `json:"tls"`
	// Cluster makes this host a node of a Kubernetes cluster (cluster.go).
	Cluster Cluster `json:"cluster"`
}

// Limits bound what one tenant can take: one sandbox's limits, creates in
// progress, and connections to the two listeners. Zero values are the
// defaults, which fit the host (see sandbox.HostMaxima).
type Limits struct {
	Memory string  `json:"memory"` // per sandbox, e.g. "16G" (default: 3/4 of the host's RAM)
	Disk   string  `json:"disk"`   // per sandbox (default: as memory)
	CPUs   float64 `json:"cpus"`   // per sandbox (default: the host's CPUs)
	Pids   int64   `json:"pids"`   // per sandbox (default 32768, or a quarter of the kernel's pid_max where fewer)
	// Creating bounds the creates in progress (default: 4 per CPU).
	Creating int `json:"creating"`
	// ConnsPerClient and Conns bound each listener's connections per
	// client address (default 4096) and in all (default 32768).
	ConnsPerClient int `json:"conns_per_client"`
	Conns          int `json:"conns"`
	// KeyRequests and KeyCreates are each API key's rates a second: API
	// requests, and creates (resumes and forks included); bursts of twice
	// the rate. 0: the defaults (api.DefaultRates: 1000 and 100); a team
	// may set its own.
	KeyRequests float64 `json:"key_requests"`
	KeyCreates  float64 `json:"key_creates"`
	// KeyDisk bounds what each key without a team, and each team
	// without a disk quota, keeps in the data directory (its paused
	// sandboxes and its snapshots), e.g. "50G"; "0": no bound. Default:
	// a quarter of the data directory's file system. A team's disk quota
	// bounds its keys instead.
	KeyDisk string `json:"key_disk"`
}

// keyDisk reads the per-key bound on the host's disk (manager.KeyDisk):
// a quarter of data's file system where none is set.
func (l Limits) keyDisk(data string) (int64, error) {
	if l.KeyDisk != "" {
		n, err := units.ParseSize(l.KeyDisk)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("limits.key_disk: %q is no size", l.KeyDisk)
		}
		return n, nil
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(data, &fs); err != nil {
		return 0, fmt.Errorf("limits.key_disk: %w", err)
	}
	return int64(fs.Blocks) * fs.Bsize / 4, nil
}

// rates reads the per-key rates.
func (l Limits) rates() api.Rates {
	r := api.DefaultRates
	if l.KeyRequests > 0 {
		r.Requests = l.KeyRequests
	}
	if l.KeyCreates > 0 {
		r.Creates = l.KeyCreates
	}
	return r
}

// maxima reads the per-sandbox ceilings.
func (l Limits) maxima() (sandbox.Maxima, error) {
	m := sandbox.Maxima{CPUs: l.CPUs, Pids: l.Pids}
	for _, f := range []struct {
		name, v string
		dst     *int64
	}{{"limits.memory", l.Memory, &m.Memory}, {"limits.disk", l.Disk, &m.Disk}} {
		if f.v == "" {
			continue
		}
		n, err := units.ParseSize(f.v)
		if err != nil {
			return m, fmt.Errorf("%s: %v", f.name, err)
		}
		*f.dst = n
	}
	if m.CPUs < 0 || m.Pids < 0 || l.Creating < 0 || l.ConnsPerClient < 0 || l.Conns < 0 || l.KeyRequests < 0 || l.KeyCreates < 0 {
		return m, fmt.Errorf("limits: negative values are not limits")
	}
	return m, nil
}

// Network configures sandbox networks.
type Network struct {
	// Subnet holds the sandboxes' addresses (default 10.209.0.0/16).
	Subnet string `json:"subnet"`
	// DNS are the resolvers allowed names are asked of ("ip" or "ip:port";
	// default: the host's /etc/resolv.conf).
	DNS []string `json:"dns"`
	// Open are always-denied ranges sandboxes may reach after all (e.g. a
	// company network, "10.20.0.0/16"); the sandbox subnet stays denied.
	Open []string `json:"open"`
}

// config turns the file's network section into the network package's.
func (n Network) config() (network.Config, error) {
	var c network.Config
	if n.Subnet != "" {
		p, err := netip.ParsePrefix(n.Subnet)
		if err != nil {
			return c, fmt.Errorf("network.subnet %q: %v", n.Subnet, err)
		}
		c.Subnet = p
	}
	var err error
	if c.Upstreams, err = network.ParseUpstreams(n.DNS); err != nil {
		return c, fmt.Errorf("network.dns: %v", err)
	}
	for _, s := range n.Open {
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() {
			return c, fmt.Errorf("network.open %q: want an IPv4 CIDR", s)
		}
		c.Open = append(c.Open, p)
	}
	return c, nil
}

// Defaults for Config.
func Defaults() Config {
	return Config{API: "127.0.0.1:3000", Proxy: "127.0.0.1:3001", Data: "/var/lib/cage", RunDir: "/run/cage",
		DefaultTemplate: "host", DefaultWall: "process", MaxTimeout: Duration(24 * time.Hour), Pool: 2, PoolGrow: 4}
}

// Duration is a time.Duration written as "90s", "1h" in the config file.
type Duration time.Duration

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration: want a string such as \"1h\"")
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// LoadFile reads a JSON config file over cfg.
func LoadFile(path string, cfg *Config) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(cfg); err != nil {
		return fmt.Errorf("config %s: %v", path, err)
	}
	for key := range cfg.Pools {
		if err := sandbox.CheckPool(key); err != nil {
			return fmt.Errorf("config %s: pools: %v", path, err)
		}
	}
	if err := CheckPoolGrow(cfg.PoolGrow); err != nil {
		return fmt.Errorf("config %s: %v", path, err)
	}
	return nil
}

// CheckPoolGrow says what is wrong with a pool_grow (--pool-grow) of n.
func CheckPoolGrow(n int) error {
	if n < 1 || n > 64 {
		return fmt.Errorf("pool_grow %d: want 1 (pools keep their size) to 64", n)
	}
	return nil
}

// Run serves until ctx ends. ready, when not nil, is called once both
// listeners accept.
func Run(ctx context.Context, cfg Config, log *slog.Logger, ready func(apiAddr, proxyAddr string)) error {
	if err := os.MkdirAll(cfg.Data, 0o700); err != nil {
		return err
	}
	if err := store.CheckDataDir(cfg.Data); err != nil {
		return err
	}
	lock, err := lockData(cfg.Data)
	if err != nil {
		return err
	}
	defer lock.Close()
	// What writes to the standard logger (net/http's reverse proxies and
	// servers without a log of their own) is the daemon's log, bounded.
	defer boundStandardLog(log)()
	// Before anything reads the pid space (sandbox.HostMaxima): the
	// kernel's host-wide limits must not be one tenant's to use up.
	sandbox.RaiseHostLimits(log)
	st, err := store.Open(cfg.Data)
	if err != nil {
		return err
	}
	defer st.Close()
	netCfg, err := cfg.Network.config()
	if err != nil {
		return err
	}
	host, err := sandbox.NewHost(cfg.RunDir, cfg.AgentPath, log)
	if err != nil {
		return err
	}
	// The daemon grows with its sandboxes: their agents are forked from a
	// small helper, never from the daemon's memory (package spawner).
	host.SpawnAgents = true
	templates := cfg.Templates
	if templates == "" {
		templates = filepath.Join(cfg.Data, "templates")
	}
	if host.Templates, err = imgstore.Open(templates); err != nil {
		return fmt.Errorf("template store: %w", err)
	}
	maxima, err := cfg.Limits.maxima()
	if err != nil {
		return err
	}
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = sandbox.DefaultMaxSandboxes()
	}
	vols, err := cfg.Volumes.manager(cfg.Data, cfg.RunDir, log)
	if err != nil {
		return err
	}
	defer vols.Close()
	trail, err := cfg.Audit.start(cfg.Data, log)
	if err != nil {
		return err
	}
	if trail != nil {
		defer trail.DB().Close()
		defer trail.Close() // after everything that records (deferred earlier, runs later)
	}
	metricsL, metricsToken, err := cfg.Metrics.listen()
	if err != nil {
		return err
	}
	var mx *metrics.Metrics // nil (counting nothing) unless served
	if metricsL != nil {
		defer metricsL.Close()
		mx = metrics.New()
	}
	hook := &changeHook{}
	var changed func(id, kind string)
	if cfg.Cluster.Kubeconfig != "" {
		changed = hook.changed
	}
	keyDisk, err := cfg.Limits.keyDisk(cfg.Data)
	if err != nil {
		return err
	}
	mgr := manager.New(manager.Config{Changed: changed, Store: st, Host: host, Log: log, MaxTimeout: time.Duration(cfg.MaxTimeout),
		DefaultTemplate: cfg.DefaultTemplate, MaxSandboxes: cfg.MaxSandboxes, MaxCreating: cfg.Limits.Creating, Max: maxima,
		Data: cfg.Data, PausedRetention: time.Duration(cfg.PausedRetention), Volumes: vols, MaxVolumes: cfg.Volumes.MaxPerKey,
		KeyDisk: keyDisk, Audit: trail, Metrics: mx})
	trail.SetOwner(mgr.Owner)
	recLimits, err := cfg.Records.limits()
	if err != nil {
		return err
	}
	recs, err := store.OpenRecords(cfg.Data)
	if err != nil {
		return err
	}
	defer recs.Close()
	mgr.StartRecords(recs, recLimits)
	defer mgr.StopRecords()
	netCfg.Record = mgr.NetRecord
	host.NetConfig = netCfg
	if err := mgr.Recover(); err != nil {
		return fmt.Errorf("recover sandboxes: %w", err)
	}
	defer mgr.Close()
	sweepCtx, stopSweep := context.WithCancel(ctx)
	defer stopSweep()
	go mgr.Sweep(sweepCtx, 5*time.Second)
	host.PoolTemplate, host.PoolGrow = cfg.PoolTemplate, cfg.PoolGrow
	if host.PoolTemplate == "" {
		host.PoolTemplate = cfg.DefaultTemplate
	}
	if host.PoolTemplate == "host" {
		// A wall of its own default (microvm: base) pools that.
		host.PoolTemplate = host.DefaultTemplate(cfg.DefaultWall)
	}
	if err := host.AddWallPool(cfg.DefaultWall, host.PoolTemplate, cfg.Pool); err != nil {
		log.Warn("pool: not kept", "wall", cfg.DefaultWall, "template", host.PoolTemplate, "why", err)
	}
	for key, n := range cfg.Pools {
		wallName, name := sandbox.PoolOf(key)
		if err := host.AddWallPool(wallName, name, n); errors.Is(err, sandbox.ErrInvalid) {
			return fmt.Errorf("pools: %q: %w", key, err)
		} else if err != nil {
			log.Warn("pool: not kept", "pool", key, "why", err)
		}
	}
	defer host.Close()

	apiL, err := net.Listen("tcp", cfg.API)
	if err != nil {
		return fmt.Errorf("control API address %s: %w", cfg.API, err)
	}
	proxyL, err := net.Listen("tcp", cfg.Proxy)
	if err != nil {
		apiL.Close()
		return fmt.Errorf("proxy address %s: %w", cfg.Proxy, err)
	}
	perClient, total := cfg.Limits.ConnsPerClient, cfg.Limits.Conns
	if perClient == 0 {
		perClient = 4096
	}
	if total == 0 {
		total = 32768
	}
	apiL, proxyL = limitConns(apiL, perClient, total), limitConns(proxyL, perClient, total)
	if err := host.WallMissing(cfg.DefaultWall); err != nil {
		return fmt.Errorf("default wall: %w", err)
	}
	for _, w := range sandbox.Walls {
		if err := host.WallMissing(w); err != nil {
			log.Warn("wall not available", "wall", w, "why", err)
			continue
		}
		go func() { // a wall's probe (microvm: KVM) may take 10 s, once per boot
			if warning := host.Warning(context.Background(), w); warning != "" {
				log.Warn(warning, "wall", w)
			}
		}()
	}
	cl, err := startCluster(ctx, cfg, hook, mgr, host, st, apiL.Addr(), proxyL.Addr(), perClient, log)
	if err != nil {
		apiL.Close()
		proxyL.Close()
		return err
	}
	if cl != nil {
		// Another node's forwards are many clients' (cluster/peers.go).
		apiL.(*connLimiter).setPeer(cl.front.Peer)
		proxyL.(*connLimiter).setPeer(cl.front.Peer)
	}
	tb := newBuilds(ctx, host)
	defer tb.stop() // before the host closes
	apiH := api.Handler(api.Config{Cluster: cl.api(), Manager: mgr, Store: st, Log: log, Domain: cfg.Domain,
		DefaultWall: cfg.DefaultWall, Audit: trail, Metrics: mx, Rates: cfg.Limits.rates(), Build: tb.build})
	// The dashboard's and /mcp's connections to the proxy, and /mcp's to
	// the API, are the daemon's own: held to each listener's bound on all
	// connections only.
	proxyDial := proxyL.(*connLimiter).dialOwn
	apiMux, stopUI, err := withUI(cfg.UI, withMCP(apiH, st, trail, apiL.Addr(), proxyL.Addr(), apiL.(*connLimiter).dialOwn, proxyDial, log), apiH, st, mgr, host,
		trail, proxyL.Addr(), proxyDial, cfg.Data, cfg.RunDir, log)
	if err != nil {
		apiL.Close()
		proxyL.Close()
		return err
	}
	apiSrv := newServer(cl.routes(apiMux), true, log)
	if stopUI != nil {
		apiSrv.RegisterOnShutdown(stopUI) // the dashboard's streams end, not waited on
	}
	px := proxy.New(mgr, cfg.Domain, log)
	px.Forward, px.Client = cl.forward(), cl.trafficClient()
	if trail != nil {
		px.Observe, px.Denied = trail.ObserveEnvd, trail.ProxyDenied
	}
	if mx != nil {
		px.Count = mx.ProxyRequest
		mx.AddState(metricsState(st, mgr, host, cfg.Data, cfg.RunDir))
	}
	proxySrv := newServer(px, false, log)
	if err := cfg.TLS.serve(proxySrv, cfg, log); err != nil {
		apiL.Close()
		proxyL.Close()
		return err
	}
	errs := make(chan error, 4)
	metricsSrv := startMetrics(metricsL, metricsToken, mx, log, errs)
	difySrv, err := startDify(cfg, mgr, host, trail, log, errs)
	if err != nil {
		apiL.Close()
		proxyL.Close()
		return err
	}
	go func() { errs <- apiSrv.Serve(apiL) }()
	go func() { errs <- serveProxy(proxySrv, proxyL) }()
	log.Info("cage serve: ready", "api", apiL.Addr().String(), "proxy", proxyL.Addr().String(),
		"data", cfg.Data, "sandboxes", mgr.Count(), "metrics", cfg.Metrics.Addr)
	if ready != nil {
		ready(apiL.Addr().String(), proxyL.Addr().String())
	}
	select {
	case <-ctx.Done():
	case err := <-errs:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = apiSrv.Shutdown(sctx)
	_ = proxySrv.Shutdown(sctx)
	if metricsSrv != nil {
		_ = metricsSrv.Shutdown(sctx)
	}
	if difySrv != nil {
		_ = difySrv.Shutdown(sctx)
	}
	log.Info("cage serve: stopped; sandboxes keep running for the next start", "sandboxes", mgr.Count())
	return nil
}

// lockData makes sure one daemon at a time uses a data directory.
func lockData(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "daemon.lock"), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("another cage serve is using %s", dir)
	}
	return f, nil
}
