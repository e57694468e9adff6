package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/units"
)

// serveWindow is how many creates each of serve's create rates is taken
// over, and serveConns how many the client keeps in flight (the daemon's
// default limits.creating on a 2-core host).
const serveWindow, serveConns = 100, 8

// benchServe measures through a cage serve it starts (pool of 4): time
// to interactive one at a time and 20 at once, the round trip through the
// proxy, and (in a fresh daemon, its pool of 4 not grown by the bursts)
// the API's create rate with none and with alive sandboxes alive. The
// per-key rate limits are lifted for it (they are a policy, not
// what the daemon can do); the server's own bounds are the defaults.
func benchServe(ctx context.Context, t *bench.Table, runs, alive int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "cage-bench-serve-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfg, _ := json.Marshal(map[string]any{"limits": map[string]any{"key_requests": 1e6, "key_creates": 1e6}})
	path := filepath.Join(dir, "cage.json")
	if err := os.WriteFile(path, cfg, 0o600); err != nil {
		return err
	}
	metricsAddr, err := bench.FreeAddr()
	if err != nil {
		return err
	}
	start := func() (*bench.Daemon, error) {
		return bench.StartDaemon(exe, 4, "--config", path, "--max-sandboxes", strconv.Itoa(alive+serveWindow), "--metrics", metricsAddr)
	}
	d, err := start()
	if err != nil {
		return err
	}
	defer func() {
		if d != nil {
			d.Stop()
		}
	}()
	c := d.Client()
	s, err := bench.TimeToInteractive(ctx, c, runs, 1)
	if err != nil {
		t.Fail("serve.tti", "", err)
	} else {
		t.Set(bench.Row{ID: "serve.tti", Cage: bench.Latency(s), Status: bench.NoTarget})
	}
	s, err = bench.TimeToInteractive(ctx, c, max(runs, 40), 20)
	if err != nil {
		t.Fail("serve.tti20", "", err)
	} else {
		t.Set(bench.Row{ID: "serve.tti20", Cage: bench.Latency(s), Status: bench.Judge(s.P50 <= 100*time.Millisecond)})
	}
	// The same bursts once the pool has grown by what the last one missed
	// (the default pool_grow) and refilled: bursts that come apart.
	s, err = bench.TimeToInteractiveBursts(ctx, c, max(runs, 40), 20, func() error {
		return bench.WaitPoolsFull(ctx, metricsAddr, 2*time.Minute)
	})
	if err != nil {
		t.Fail("serve.tti20.grown", "", err)
	} else {
		t.Set(bench.Row{ID: "serve.tti20.grown", Cage: bench.Latency(s), Status: bench.Judge(s.P50 <= 100*time.Millisecond)})
	}
	s, err = bench.ProxyRoundTrip(ctx, c, max(runs, 200))
	if err != nil {
		t.Fail("serve.roundtrip", "", err)
	} else {
		t.Set(bench.Row{ID: "serve.roundtrip", Cage: bench.Latency(s), Status: bench.NoTarget})
	}
	// The create rates in a daemon of their own: the bursts above grew its
	// pool (pool_grow), whose members, made before, would serve the first
	// window.
	d.Stop()
	fresh, err := start()
	if err != nil {
		d = nil
		t.Fail("serve.rate", "", err)
		return nil
	}
	d = fresh
	r, err := bench.CreateRates(ctx, d, alive, serveWindow, serveConns)
	if err != nil {
		t.Fail("serve.rate", "", err)
		return nil
	}
	rate := bench.Row{ID: "serve.rate", What: fmt.Sprintf("API creates/s (process wall), the first %d, %d in flight", r.Window, r.Conns),
		Cage: bench.Quantity(r.Empty, "creates/s"), Status: bench.Judge(r.Empty >= 200), Note: "Firecracker: about 150/s per host (published)"}
	// Its peer, right after: what this machine does with bare namespaced
	// sandboxes at the same concurrency, each started, run and ended.
	if bw, err := bench.BwrapArgv("true"); err != nil {
		rate.Note += "; no peer: " + err.Error()
	} else if pr, err := bench.RunRate(bw, r.Window, r.Conns); err != nil {
		rate.Note += "; the peer: " + err.Error()
	} else {
		rate.Peer, rate.Ratio = bench.Quantity(pr, "runs/s"), r.Empty/pr
	}
	t.Set(rate)
	flat := r.Full / r.Empty
	t.Set(bench.Row{ID: "serve.rate.alive", What: fmt.Sprintf("API creates/s, the last %d of %d alive", r.Window, r.Alive),
		Cage: bench.Quantity(r.Full, "creates/s"), PeerName: "the first " + strconv.Itoa(r.Window), Peer: bench.Quantity(r.Empty, "creates/s"),
		Ratio: flat, Status: bench.Judge(r.Full >= 200 && flat >= 0.9)})
	t.Set(cpuRow("serve.cpu", fmt.Sprintf("CPU per API create, the first %d (the whole host's)", r.Window), r.EmptyCPU, nil))
	t.Set(cpuRow("serve.cpu.alive", fmt.Sprintf("CPU per API create, the last %d of %d alive (the whole host's)", r.Window, r.Alive),
		r.FullCPU, &r.EmptyCPU))
	t.Set(bench.Row{ID: "serve.rss", What: fmt.Sprintf("daemon resident memory with %d alive", r.Alive),
		Cage: bench.Quantity(float64(r.RSSFull)/(1<<20), "MiB"), Status: bench.NoTarget,
		Note: "idle before: " + units.FormatSize(roundKiB(r.RSSBefore))})
	return nil
}

// cpuRow is a window's CPU per create and where it went (bench.CPUSplit),
// beside the first window's where there is one: what grows with the
// sandboxes alive. 200 creates/s on 2 CPUs leaves 10 ms for all of it.
func cpuRow(id, what string, s bench.CPUSplit, first *bench.CPUSplit) bench.Row {
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	row := bench.Row{ID: id, What: what, Cage: bench.Quantity(ms(s.Host), "ms"), Status: bench.NoTarget,
		Note: fmt.Sprintf("in the sandboxes' cgroups %.2f ms, the daemon %.2f ms, its spawner %.2f ms (whose forks run in the sandboxes' cgroups: the parts overlap)",
			ms(s.Sandboxes), ms(s.Daemon), ms(s.Spawner))}
	if first != nil && first.Host > 0 {
		row.PeerName, row.Peer, row.Ratio = "the first window", bench.Quantity(ms(first.Host), "ms"), float64(s.Host)/float64(first.Host)
	}
	return row
}
