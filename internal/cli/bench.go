package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

func newBenchCmd(g *globals) *cobra.Command {
	var o benchOptions
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure start latency, round trip, throughput and memory against peers in the same run",
		Long: `Measure what users feel, with the peer measured in the same run, and print
one table: each figure beside its peer, its target, and whether it is met.
A measurement whose samples fail marks its row failed and the bench exits
125; rows asked for but not measured say why. --json writes the same table
as JSON, for tracking.
  run        cage run -- true as a whole process, against bwrap --unshare-all (interleaved)
  create     in-process create -> first output of a command, cold and from a
             pool of 4 (full before each sample)
  roundtrip  Start -> end of true in a live sandbox, against the same true
             forked, run and waited for bare by cage bench (interleaved)
  memory     host memory per idle sandbox with --idle sandboxes alive at once
  walls      each OCI wall (runc, gvisor): create -> first output against the
             runtime running the same command bare in an equivalent bundle
             (interleaved), cold and from the wall's pool where the walls
             keep pools, and memory with 50 idle sandboxes of each
  microvm    the microvm wall (base): create, restored from its snapshot ->
             first output, interleaved with the process wall's (under TCG
             with the blocks of guest code translated on the way), and from
             a pool where the walls keep pools; QEMU's PSS and host cgroup
             charge with 20 idle VMs restored from one snapshot
  serve      against a cage serve it starts: time to interactive (create -> first
             output through the API and proxy) sequential and 20 at once, the
             round trip through the proxy, and creates through the API, 8 at a
             time, until --alive sandboxes are alive: the rate of the first 100
             and of the last 100 (per-key rate limits lifted), daemon memory
  audit      what the audit trail costs: create -> first output through cage serve
             with the trail and without (interleaved; ratio of medians), the round
             trip through the proxy, and another tenant's API latency while a
             sandbox runs 10,000 commands in a loop, each with and without
  metrics    what Prometheus metrics cost: create -> first output through cage
             serve with /metrics served (scraped every second) and without
             (interleaved; ratio of medians), and a scrape's time
  interp     the code interpreter (template code-interpreter-v1), as
             @e2b/code-interpreter uses it through cage serve: create -> first
             runCode('1+1') result from a pool of started sandboxes and cold,
             and runCode('1+1') in a live context
  dify       Dify's code nodes through cage serve --dify: a python3 main
             returning a dict, one at a time against a seccomp-only runner
             (dify-sandbox's design) interleaved, and 100 runs at once
  mcp        against a cage serve it starts: the exec tool's round trip (true)
             over MCP's stdio (cage mcp) and streamable HTTP (/mcp), interleaved
             with the same command through the E2B protocol (the peer)
  desktop    the desktop template as @e2b/desktop uses it through cage serve:
             create (Xvfb and XFCE up, polled as the SDK polls) -> first
             screenshot, the screenshot round trip, an idle desktop's memory
  durable    pause, resume and fork on every wall (minutes)
  cluster    three cage serve nodes in network namespaces of a real control
             plane ($CAGE_KUBE_DIR, scripts/kube.sh; root): claim -> first
             output through node a's front (pools of 4), claims/s with 24
             clients over the three fronts for 10 s, API server requests per
             claim, a sandbox pod's size; then one cage serve the same way`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			return runBench(ctx, g, cmd.OutOrStdout(), o)
		},
	}
	cmd.AddCommand(newSeccompExecCmd())
	cmd.Flags().IntVar(&o.runs, "runs", 30, "samples per measurement")
	cmd.Flags().IntVar(&o.idle, "idle", 200, "sandboxes alive at once for the memory measurement")
	cmd.Flags().IntVar(&o.alive, "alive", 1000, "sandboxes alive at the end of serve's create-rate measurement")
	cmd.Flags().StringVar(&o.only, "only", "run,create,roundtrip,memory,serve,walls,microvm", "measurements to take (also audit, metrics, interp, desktop, dify, mcp, durable, cluster)")
	cmd.Flags().BoolVar(&o.json, "json", false, "write the table as JSON")
	return cmd
}

type benchOptions struct {
	runs, idle, alive int
	only              string
	json              bool
}

// benchOrder is the order measurements run in (the memory one last: it
// leaves the most behind for the kernel to reclaim).
var benchOrder = []string{"run", "create", "roundtrip", "serve", "dify", "audit", "metrics", "interp", "desktop", "mcp", "walls", "microvm", "durable", "cluster", "memory"}

func runBench(ctx context.Context, g *globals, w io.Writer, o benchOptions) error {
	if o.runs < 1 || o.idle < 1 || o.alive < 2 {
		return exitf(ExitUsage, "--runs and --idle must be at least 1, --alive at least 2")
	}
	want := map[string]bool{}
	for _, s := range strings.Split(o.only, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(benchOrder, s) {
			return exitf(ExitUsage, "--only: no measurement %q (want some of %s)", s, strings.Join(benchOrder, ", "))
		}
		want[s] = true
	}
	h, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return err
	}
	defer h.Close() // the network's resolver, where a measurement started it
	machine := bench.DescribeMachine(h.Cgroups.Mode.String())
	t := &bench.Table{}
	for _, name := range benchOrder {
		if want[name] {
			t.Expect(expectedRows[name]...)
		}
	}
	b := &benchRun{g: g, h: h, t: t, o: o}
	for _, name := range benchOrder {
		if !want[name] {
			continue
		}
		if err := b.measure(ctx, name); err != nil {
			t.Fail(name, name+": the measurement", err)
		}
	}
	return finishBench(w, t, machine, o.json)
}

// finishBench writes the table, as text or JSON; a failed row fails the
// bench.
func finishBench(w io.Writer, t *bench.Table, m bench.Machine, asJSON bool) error {
	if asJSON {
		if err := t.JSON(w, m); err != nil {
			return err
		}
	} else {
		t.Print(w, m)
	}
	if t.Failed() {
		return exitf(ExitInternal, "bench: a measurement failed (its row says why)")
	}
	return nil
}

// benchRun is what one bench's measurements share.
type benchRun struct {
	g *globals
	h *sandbox.Host
	t *bench.Table
	o benchOptions
}

func (b *benchRun) measure(ctx context.Context, name string) error {
	runs := b.o.runs
	switch name {
	case "run":
		return benchWholeRun(b.t, b.g, runs)
	case "create":
		return benchCreate(ctx, b.t, b.g, b.h, runs)
	case "roundtrip":
		s, peer, err := bench.RoundTrip(ctx, b.h, max(runs, 200))
		if err != nil {
			b.t.Fail("roundtrip", "", err)
			return nil
		}
		b.t.Set(bench.Row{ID: "roundtrip", Cage: bench.Latency(s), Peer: bench.Latency(peer), Ratio: stats.Ratio(s, peer),
			Status: bench.Judge(s.P50 <= 1500*time.Microsecond && s.P99 <= 5*time.Millisecond)})
	case "serve":
		return benchServe(ctx, b.t, runs, b.o.alive)
	case "dify":
		return benchDify(ctx, b.t, b.h, runs)
	case "audit":
		return benchAudit(ctx, b.t, runs)
	case "metrics":
		return benchMetrics(ctx, b.t, runs)
	case "interp":
		return benchInterp(ctx, b.t, b.h, runs)
	case "mcp":
		return benchMCP(ctx, b.t, max(runs, 200))
	case "desktop":
		return benchDesktop(ctx, b.t, b.h, runs)
	case "walls":
		return benchWalls(ctx, b.t, b.g, b.h, runs)
	case "microvm":
		return benchMicroVM(ctx, b.t, b.g, b.h, runs)
	case "durable":
		return benchDurable(ctx, b.t, b.h, runs)
	case "cluster":
		return benchCluster(ctx, b.t, b.g, runs)
	case "memory":
		m, err := bench.IdleMemory(ctx, b.h, b.o.idle)
		if err != nil {
			b.t.Fail("memory", "", err)
			return nil
		}
		b.t.Set(bench.Row{ID: "memory", What: fmt.Sprintf("host memory per idle sandbox, %d alive (MemAvailable drop)", m.N),
			Cage: perSandbox(m), Status: memStatus(m),
			Note: fmt.Sprintf("agent PSS %s, cgroup charge %s; created %.1f sandboxes/s in process, one at a time",
				units.FormatSize(roundKiB(m.AgentPSSBytes)), units.FormatSize(roundKiB(m.CgroupBytes)), m.CreateRate)})
	}
	return nil
}

func roundKiB(n int64) int64 { return n / 1024 * 1024 }

func benchWholeRun(t *bench.Table, g *globals, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cage := []string{exe, "--run-dir", g.runDir, "run", "--", "true"}
	bw, bwErr := bench.BwrapArgv("true")
	if bwErr != nil {
		s, err := bench.WholeProcess(cage, runs)
		if err != nil {
			t.Fail("run", "", err)
			return nil
		}
		t.Set(bench.Row{ID: "run", Cage: bench.Latency(s), Status: bench.NotMeasured, Note: "no peer: " + bwErr.Error()})
		return nil
	}
	st, err := bench.Interleaved([][]string{cage, bw}, runs)
	if err != nil {
		t.Fail("run", "", err)
		return nil
	}
	r := stats.Ratio(st[0], st[1])
	t.Set(bench.Row{ID: "run", Cage: bench.Latency(st[0]), Peer: bench.Latency(st[1]), Ratio: r, Status: bench.Judge(r <= 2)})
	return nil
}

// benchCreate measures create -> first output in this process, cold and
// from a pool of 4 that is full before each sample, each sample followed
// by one of its peer: bubblewrap's sandbox running the same echo, to its
// first output (where bwrap is installed).
func benchCreate(ctx context.Context, t *bench.Table, g *globals, h *sandbox.Host, runs int) error {
	bw, bwErr := bench.BwrapArgv("echo", "ready")
	peer := func() (time.Duration, error) { return bench.FirstOutput(bw) }
	withPeer := func(row bench.Row, s, p stats.Stats) bench.Row {
		if bwErr != nil {
			row.Note = "no peer: " + bwErr.Error()
			return row
		}
		row.Peer, row.Ratio = bench.Latency(p), stats.Ratio(s, p)
		return row
	}
	var s, p stats.Stats
	var err error
	if bwErr != nil {
		s, err = bench.CreateToFirstOutput(ctx, h, runs)
	} else {
		s, p, err = bench.CreateToFirstOutputVs(ctx, h, runs, peer)
	}
	if err != nil {
		t.Fail("create.cold", "", err)
	} else {
		t.Set(withPeer(bench.Row{ID: "create.cold", Cage: bench.Latency(s), Status: bench.Judge(s.P50 <= 10*time.Millisecond)}, s, p))
	}
	pooled, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return err
	}
	defer pooled.Close()
	pooled.StartPool(4)
	var missed int64
	if bwErr != nil {
		s, missed, err = bench.PooledToFirstOutput(ctx, pooled, "process", runs, 3)
	} else {
		s, p, missed, err = bench.PooledToFirstOutputVs(ctx, pooled, "process", runs, 3, peer)
	}
	if err != nil {
		t.Fail("create.pool", "", err)
		return nil
	}
	row := withPeer(bench.Row{ID: "create.pool", Cage: bench.Latency(s),
		Status: bench.Judge(s.P50 <= 5*time.Millisecond && s.P99 <= 10*time.Millisecond)}, s, p)
	if n := poolNote(missed); n != "" {
		row.Note = strings.TrimPrefix(row.Note+"; "+n, "; ")
	}
	t.Set(row)
	return nil
}

func poolNote(missed int64) string {
	if missed == 0 {
		return ""
	}
	return fmt.Sprintf("%d creates found the full pool empty all the same; left out", missed)
}
