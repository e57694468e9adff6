package daemon

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/metrics"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// Metrics configures Prometheus's /metrics (internal/metrics). It is off
// unless Addr is set, and served on a listener of its own, never on the
// API's or the proxy's: only whoever reaches Addr scrapes it. An address
// that is not loopback needs a token (TokenFile: a file holding it, which
// Prometheus sends as `Authorization: Bearer`; its credentials_file).
type Metrics struct {
	Addr      string `json:"addr"`       // e.g. "127.0.0.1:9464"; "" is off
	TokenFile string `json:"token_file"` // the bearer token's file; required off loopback
}

// listen opens the metrics listener and reads the token (nil, "" when
// off).
func (c Metrics) listen() (net.Listener, string, error) {
	if c.Addr == "" {
		return nil, "", nil
	}
	var token string
	if c.TokenFile != "" {
		b, err := os.ReadFile(c.TokenFile)
		if err != nil {
			return nil, "", fmt.Errorf("metrics.token_file: %w", err)
		}
		if token = strings.TrimSpace(string(b)); len(token) < 16 || strings.ContainsAny(token, " \t\r\n") {
			return nil, "", fmt.Errorf("metrics.token_file %s: want one token of at least 16 characters", c.TokenFile)
		}
	}
	host, _, err := net.SplitHostPort(c.Addr)
	if err != nil {
		return nil, "", fmt.Errorf("metrics address %q: %v", c.Addr, err)
	}
	if ip := net.ParseIP(host); token == "" && (ip == nil || !ip.IsLoopback()) {
		return nil, "", fmt.Errorf("metrics address %q is not loopback: give it a token (metrics.token_file) or listen on 127.0.0.1", c.Addr)
	}
	l, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return nil, "", fmt.Errorf("metrics address %s: %w", c.Addr, err)
	}
	return l, token, nil
}

// startMetrics serves the registry on its listener; the returned server
// (nil when off) is shut down with the others.
func startMetrics(l net.Listener, token string, m *metrics.Metrics, log *slog.Logger, errs chan<- error) *http.Server {
	if l == nil {
		return nil
	}
	srv := newServer(m.Handler(token), true, log)
	go func() { errs <- srv.Serve(limitConns(l, 64, 256)) }()
	log.Info("metrics: serving /metrics", "addr", l.Addr().String(), "token", token != "")
	return srv
}

// metricsState is what the daemon reads at each scrape.
func metricsState(st *store.Store, mgr *manager.Manager, host *sandbox.Host, data, run string) metrics.State {
	return metrics.State{
		Sandboxes: func() ([]metrics.SandboxGroup, error) {
			cs, err := st.SandboxCounts()
			if err != nil {
				return nil, err
			}
			merged := map[metrics.SandboxGroup]int{}
			for _, c := range cs {
				tmpl := c.Template
				if manager.IsSnapshotRef(tmpl) {
					tmpl = "snapshot" // a snapshot's id is a tenant's, never a label
				}
				merged[metrics.SandboxGroup{State: c.State, Wall: c.Wall, Template: tmpl}] += c.N
			}
			out := make([]metrics.SandboxGroup, 0, len(merged))
			for g, n := range merged {
				g.N = n
				out = append(out, g)
			}
			return out, nil
		},
		Pools: func() []metrics.Pool {
			var out []metrics.Pool
			for _, p := range host.PoolStats() {
				out = append(out, metrics.Pool{Template: p.Template, Wall: p.Wall, Ready: p.Ready, Size: p.Size,
					Hits: p.Hits, Misses: p.Misses})
			}
			return out
		},
		Headroom: func() metrics.Headroom {
			h := metrics.Headroom{CPUs: float64(runtime.NumCPU())}
			h.MemTotal, h.MemAvailable = meminfo()
			if u, err := st.TotalUsage(manager.PauseMemory); err == nil {
				h.CommittedCPUs, h.CommittedMemory, h.CommittedDisk = u.CPUs, u.Memory, u.Disk
			}
			h.DataFree, h.RunFree = freeBytes(data), freeBytes(run)
			h.LiveSandboxes, h.MaxSandboxes, h.CreatesInFlight, h.MaxCreating = mgr.Load()
			return h
		},
		Teams: func() ([]metrics.TeamUse, error) {
			ts, err := st.ListTeams()
			if err != nil {
				return nil, err
			}
			out := make([]metrics.TeamUse, 0, len(ts))
			for _, t := range ts {
				u, err := st.Usage(t.ID, manager.PauseMemory)
				if err != nil {
					return nil, err
				}
				l := t.Limits
				q := map[string]float64{}
				for name, v := range map[string]float64{"sandboxes": float64(l.Sandboxes), "cpus": l.CPUs,
					"memory_bytes": float64(l.Memory), "disk_bytes": float64(l.Disk), "paused": float64(l.Paused)} {
					if v > 0 {
						q[name] = v
					}
				}
				out = append(out, metrics.TeamUse{Name: t.Name, Quota: q, Usage: map[string]float64{
					"sandboxes": float64(u.Sandboxes), "cpus": u.CPUs, "memory_bytes": float64(u.Memory),
					"disk_bytes": float64(u.Disk), "paused": float64(u.Paused)}})
			}
			return out, nil
		},
	}
}

// meminfo is the host's MemTotal and MemAvailable in bytes (0 unknown).
func meminfo() (total, avail int64) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "MemTotal:":
			total = n << 10
		case "MemAvailable:":
			avail = n << 10
		}
	}
	return total, avail
}

// freeBytes is what an unprivileged writer may still use where dir is.
func freeBytes(dir string) int64 {
	var s unix.Statfs_t
	if dir == "" || unix.Statfs(dir, &s) != nil {
		return 0
	}
	return int64(s.Bavail) * s.Bsize
}
