package daemon

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/dify"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

// Dify configures the Dify-compatible sandbox API (package dify), a
// listener of its own, off unless addr is set (Dify's port is 8194).
type Dify struct {
	Addr string `json:"addr"`
	// Key is what Dify sends as X-Api-Key (its CODE_EXECUTION_API_KEY);
	// required with addr.
	Key      string   `json:"key"`
	Template string   `json:"template"` // default base
	Wall     string   `json:"wall"`     // default: the daemon's default wall
	Timeout  Duration `json:"timeout"`  // a run's wall time (default 15s)
	Memory   string   `json:"memory"`   // per run (default 256M)
	CPUs     float64  `json:"cpus"`     // per run (default 1)
	Pids     int64    `json:"pids"`     // per run (default 128)
	// Network is a run's policy when it asks for the network, as Dify
	// always does (default {"mode": "internet"}; {"mode": "allowlist",
	// "allow": [...]} names what runs may reach; {"mode": "none"}).
	Network *network.Policy `json:"network"`
	// Pool is how many sandboxes of the template the daemon keeps ready
	// for runs (default 4), on the runs' wall; pools may name the
	// template too (the first wins).
	Pool        *int   `json:"pool"`
	MaxRequests int    `json:"max_requests"` // runs in flight (default 200; beyond, 503)
	MaxWorkers  int    `json:"max_workers"`  // runs with a sandbox at once (default 4 per CPU)
	MaxOutput   string `json:"max_output"`   // stdout, and stderr, kept per run (default 4M)
	MaxBody     string `json:"max_body"`     // a request's body (default 16M)
}

// config reads the section into the service's configuration.
func (d Dify) config() (dify.Config, error) {
	c := dify.Config{Key: d.Key, Template: d.Template, Wall: d.Wall, Timeout: time.Duration(d.Timeout), CPUs: d.CPUs,
		Pids: d.Pids, Network: d.Network, MaxRequests: d.MaxRequests, MaxWorkers: d.MaxWorkers}
	for _, f := range []struct {
		name, v string
		dst     *int64
	}{{"dify.memory", d.Memory, &c.Memory}, {"dify.max_output", d.MaxOutput, &c.MaxOutput}, {"dify.max_body", d.MaxBody, &c.MaxBody}} {
		if f.v == "" {
			continue
		}
		n, err := units.ParseSize(f.v)
		if err != nil {
			return c, fmt.Errorf("%s: %v", f.name, err)
		}
		*f.dst = n
	}
	if d.Key == "" {
		return c, fmt.Errorf("dify.key (or CAGE_DIFY_KEY) is required with a dify address: the key Dify sends as CODE_EXECUTION_API_KEY")
	}
	if d.Pool != nil && (*d.Pool < 0 || *d.Pool > 1000) {
		return c, fmt.Errorf("dify.pool %d: want 0 to 1000", *d.Pool)
	}
	return c, nil
}

// startDify listens on cfg.Dify.Addr and serves the Dify API until the
// returned server is shut down; nil when the listener is off. Errors of
// Serve go to errs.
func startDify(cfg Config, mgr *manager.Manager, host *sandbox.Host, trail *audit.Trail,
	log *slog.Logger, errs chan<- error) (*http.Server, error) {
	if cfg.Dify.Addr == "" {
		return nil, nil
	}
	dc, err := cfg.Dify.config()
	if err != nil {
		return nil, err
	}
	if dc.Wall == "" {
		dc.Wall = cfg.DefaultWall
	}
	dc.Audit = trail
	if err := host.WallMissing(dc.Wall); err != nil {
		return nil, fmt.Errorf("dify.wall: %w", err)
	}
	srv, err := dify.New(dc, mgr, log)
	if err != nil {
		return nil, err
	}
	if t := srv.Lifetime(); cfg.MaxTimeout > 0 && t > time.Duration(cfg.MaxTimeout) {
		return nil, fmt.Errorf("dify.timeout: a run's sandbox lives up to %v, above max_timeout (%v)", t, time.Duration(cfg.MaxTimeout))
	}
	if dc.Key == "dify-sandbox" {
		log.Warn("dify: the key is dify-sandbox's well-known default; anyone who reaches the listener can run code")
	}
	pool := 4
	if cfg.Dify.Pool != nil {
		pool = *cfg.Dify.Pool
	}
	if err := host.AddWallPool(dc.Wall, srv.Template(), pool); err != nil {
		log.Warn("dify: pool not kept", "wall", dc.Wall, "why", err)
	}
	l, err := net.Listen("tcp", cfg.Dify.Addr)
	if err != nil {
		return nil, fmt.Errorf("dify address %s: %w", cfg.Dify.Addr, err)
	}
	perClient, total := cfg.Limits.ConnsPerClient, cfg.Limits.Conns
	if perClient == 0 {
		perClient = 4096
	}
	if total == 0 {
		total = 32768
	}
	hs := newServer(srv.Handler(), true, log)
	go func() { errs <- hs.Serve(limitConns(l, perClient, total)) }()
	log.Info("cage serve: dify sandbox API", "addr", l.Addr().String(), "template", srv.Template(), "wall", dc.Wall)
	return hs, nil
}
