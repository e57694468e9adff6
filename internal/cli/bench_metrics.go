package cli

import (
	"context"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
)

// benchMetrics measures what Prometheus metrics cost the API: two daemons
// with a pool of 4, one serving /metrics (scraped every second meanwhile)
// and one without, create -> first output interleaved.
func benchMetrics(ctx context.Context, t *bench.Table, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := l.Addr().String()
	l.Close()
	dOn, err := bench.StartDaemon(exe, 4, "--metrics", addr)
	if err != nil {
		return err
	}
	defer dOn.Stop()
	dOff, err := bench.StartDaemon(exe, 4)
	if err != nil {
		return err
	}
	defer dOff.Stop()
	on, off, scrapes, size, err := bench.MetricsTTI(ctx, dOn, dOff, addr, runs, time.Second)
	if err != nil {
		return err
	}
	r := stats.Ratio(on, off)
	t.Set(bench.Row{ID: "metrics.tti", What: "metrics: create -> first output, /metrics served and scraped every 1 s", Cage: bench.Latency(on),
		PeerName: "no metrics", Peer: bench.Latency(off), Ratio: r, Target: "<= 1.05x", Status: bench.Judge(r <= 1.05)})
	t.Set(bench.Row{ID: "metrics.scrape", What: fmt.Sprintf("metrics: a scrape of /metrics (%d bytes)", size), Cage: bench.Latency(scrapes), Status: bench.NoTarget})
	return nil
}
