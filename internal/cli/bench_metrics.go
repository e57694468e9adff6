package cli

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
)

// benchMetrics measures what Prometheus metrics cost the API: two daemons
// with a pool of 4, one serving /metrics (scraped every second meanwhile)
// and one without, create -> first output interleaved.
func benchMetrics(ctx context.Context, w io.Writer, runs int) error {
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
		return exitf(ExitInternal, "metrics: %v", err)
	}
	defer dOn.Stop()
	dOff, err := bench.StartDaemon(exe, 4)
	if err != nil {
		return exitf(ExitInternal, "metrics: %v", err)
	}
	defer dOff.Stop()
	on, off, scrapes, size, err := bench.MetricsTTI(ctx, dOn, dOff, addr, runs, time.Second)
	if err != nil {
		return exitf(ExitInternal, "metrics: %v", err)
	}
	fmt.Fprintf(w, "metrics: create -> first output, /metrics served and scraped every 1 s  %s\n", on)
	fmt.Fprintf(w, "metrics: create -> first output, no metrics                          %s\n", off)
	fmt.Fprintf(w, "metrics: ratio of medians on/off                                     %.3fx (target <= 1.05)\n", stats.Ratio(on, off))
	fmt.Fprintf(w, "metrics: a scrape of /metrics (%d bytes)                              %s\n", size, scrapes)
	return nil
}
