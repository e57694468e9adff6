package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/dify"
	"github.com/cagehq/cage/internal/sandbox"
)

// difyConcurrent is how many runs the throughput measurement sends at once
// (dify #13147: dify-sandbox fails some at 100).
const difyConcurrent = 100

// benchDify measures Dify's code nodes through cage serve --dify (the base
// template, the process wall, a pool of 4, Dify's default of a network)
// against the seccomp-only peer (dify-sandbox's design) in the same run:
// latency one run at a time, interleaved, and 100 runs at once.
func benchDify(ctx context.Context, t *bench.Table, h *sandbox.Host, runs int) error {
	if h.Templates == nil {
		var err error
		if h.Templates, err = openTemplates(""); err != nil {
			return err
		}
	}
	if _, err := h.Template(dify.DefaultTemplate); err != nil {
		t.Skip("dify", "dify: code nodes", fmt.Sprintf("%v (make base builds it)", err))
		return nil
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "cage-bench-dify-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	workers := 4 * runtime.NumCPU()
	cfg, _ := json.Marshal(map[string]any{"dify": map[string]any{"key": bench.DifyKey, "pool": 4, "max_workers": workers}})
	path := filepath.Join(dir, "cage.json")
	if err := os.WriteFile(path, cfg, 0o600); err != nil {
		return err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := l.Addr().String()
	l.Close()
	d, err := bench.StartDaemon(exe, 0, "--dify", addr, "--config", path)
	if err != nil {
		return err
	}
	defer d.Stop()
	cageURL := "http://" + addr
	if err := waitHealthy(cageURL); err != nil {
		return err
	}
	peer, err := bench.StartSeccompPeer(exe, workers, 2*difyConcurrent, dify.DefaultTimeout)
	if err != nil {
		t.Skip("dify", "dify: code nodes", err.Error())
		return nil
	}
	defer peer.Stop()
	lat, err := bench.DifyLatency(ctx, []string{cageURL, peer.URL}, runs)
	if err != nil {
		return err
	}
	t.Set(bench.Row{ID: "dify.latency", What: "dify: python3 main -> dict, one at a time (base, process wall, pool of 4)", Cage: bench.Latency(lat[0]),
		PeerName: fmt.Sprintf("seccomp-only runner (uid %d, no namespaces or limits)", bench.PeerUID), Peer: bench.Latency(lat[1]),
		Ratio: stats.Ratio(lat[0], lat[1]), Status: bench.NoTarget})
	var rs [2]bench.Throughput
	for i, url := range []string{cageURL, peer.URL} {
		time.Sleep(2 * time.Second) // a pool refilled, a machine settled
		rs[i] = bench.DifyThroughput(ctx, url, difyConcurrent)
	}
	note := fmt.Sprintf("%d workers; %d and %d failed", workers, rs[0].Failed, rs[1].Failed)
	if rs[0].First != nil {
		note += "; cage's first failure: " + rs[0].First.Error()
	}
	t.Set(bench.Row{ID: "dify.throughput", What: fmt.Sprintf("dify: %d at once", difyConcurrent), Cage: bench.Quantity(rs[0].PerSecond(), "runs/s"),
		PeerName: "seccomp-only runner", Peer: bench.Quantity(rs[1].PerSecond(), "runs/s"), Ratio: rs[0].PerSecond() / rs[1].PerSecond(),
		Status: bench.NoTarget, Note: note})
	if rs[0].Failed > 0 {
		t.Fail("dify.throughput", "", fmt.Errorf("%d of %d runs failed at once: %v", rs[0].Failed, difyConcurrent, rs[0].First))
	}
	return nil
}

func waitHealthy(url string) error {
	for i := 0; i < 250; i++ {
		if resp, err := http.Get(url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("the dify listener at %s does not answer", url)
}

// newSeccompExecCmd is the seccomp peer's runner (bench.SeccompExec),
// hidden: `cage bench seccomp-exec -- /usr/bin/python3 -`.
func newSeccompExecCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "seccomp-exec -- ARGV...",
		Short:  "Run ARGV as the Dify benchmark's seccomp-only peer runs code",
		Hidden: true,
		Args:   cobra.MinimumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return exitf(ExitInternal, "%v", bench.SeccompExec(args))
		},
	}
}
