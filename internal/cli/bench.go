package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

func newBenchCmd(g *globals) *cobra.Command {
	var runs, idle int
	var only string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure start latency, round trip and memory against peers in the same run",
		Long: `Measure what users feel, with the peer measured in the same run:
  run        cage run -- true as a whole process, against bwrap --unshare-all (interleaved)
  create     in-process create -> first output of a command
  roundtrip  Start -> end of true in a live sandbox
  memory     host memory per idle sandbox with --idle sandboxes alive at once
  walls      each OCI wall (runc, gvisor): create -> first output against the
             runtime running the same command bare in an equivalent bundle
             (interleaved), and memory with 50 idle sandboxes of each
  microvm    the microvm wall (base): create, restored from its snapshot ->
             first output, interleaved with the process wall's; QEMU's PSS and
             host cgroup charge with 20 idle VMs restored from one snapshot
  serve      against a cage serve it starts: time to interactive (create -> first
             output through the API and proxy) sequential and 20 at once, the
             round trip through the proxy, and --idle sandboxes created through
             the API (rate, daemon memory)
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
             with the same command through the E2B protocol (the peer)`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			return runBench(ctx, g, cmd.OutOrStdout(), runs, idle, only)
		},
	}
	cmd.AddCommand(newSeccompExecCmd())
	cmd.Flags().IntVar(&runs, "runs", 30, "samples per measurement")
	cmd.Flags().IntVar(&idle, "idle", 200, "sandboxes alive at once for the memory measurement")
	cmd.Flags().StringVar(&only, "only", "run,create,roundtrip,memory,serve,walls,microvm", "measurements to take (also durable: pause, resume and fork on every wall, minutes)")
	return cmd
}

func runBench(ctx context.Context, g *globals, w io.Writer, runs, idle int, only string) error {
	if runs < 1 || idle < 1 {
		return exitf(ExitUsage, "--runs and --idle must be at least 1")
	}
	want := map[string]bool{}
	for _, s := range strings.Split(only, ",") {
		want[strings.TrimSpace(s)] = true
	}
	h, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return err
	}
	if want["run"] {
		if err := benchRun(w, g, runs); err != nil {
			return err
		}
	}
	if want["create"] {
		s, err := bench.CreateToFirstOutput(ctx, h, runs)
		if err != nil {
			return exitf(ExitInternal, "create: %v", err)
		}
		fmt.Fprintf(w, "create -> first output (in process)   %s\n", s)
		pooled, err := sandbox.NewHost(g.runDir, "", g.log)
		if err != nil {
			return err
		}
		pooled.StartPool(4)
		time.Sleep(500 * time.Millisecond) // let it fill
		s, err = bench.CreateToFirstOutput(ctx, pooled, runs)
		pooled.Close()
		if err != nil {
			return exitf(ExitInternal, "create (pool): %v", err)
		}
		fmt.Fprintf(w, "  ... from a pool of 4 prepared        %s (pool empty %d times)\n", s, pooled.PoolMisses())
	}
	if want["roundtrip"] {
		s, err := bench.RoundTrip(ctx, h, max(runs, 200))
		if err != nil {
			return exitf(ExitInternal, "roundtrip: %v", err)
		}
		fmt.Fprintf(w, "round trip Start -> end of true      %s\n", s)
	}
	if want["serve"] {
		if err := benchServe(ctx, w, runs, idle); err != nil {
			return err
		}
	}
	if want["dify"] {
		if err := benchDify(ctx, w, h, runs); err != nil {
			return err
		}
	}
	if want["audit"] {
		if err := benchAudit(ctx, w, runs); err != nil {
			return err
		}
	}
	if want["metrics"] {
		if err := benchMetrics(ctx, w, runs); err != nil {
			return err
		}
	}
	if want["interp"] {
		if err := benchInterp(ctx, w, h, runs); err != nil {
			return err
		}
	}
	if want["mcp"] {
		if err := benchMCP(ctx, w, max(runs, 200)); err != nil {
			return err
		}
	}
	if want["walls"] {
		if err := benchWalls(ctx, w, h, runs); err != nil {
			return err
		}
	}
	if want["microvm"] {
		if err := benchMicroVM(ctx, w, h, runs); err != nil {
			return err
		}
	}
	if want["durable"] {
		if err := benchDurable(ctx, w, h, runs); err != nil {
			return err
		}
	}
	if want["memory"] {
		m, err := bench.IdleMemory(ctx, h, idle)
		if err != nil {
			return exitf(ExitInternal, "memory: %v", err)
		}
		fmt.Fprintf(w, "memory with %d idle sandboxes: %s per sandbox (MemAvailable drop), agent PSS %s, cgroup charge %s; created %.1f sandboxes/s\n",
			m.N, units.FormatSize(roundKiB(m.PerSandboxBytes)), units.FormatSize(roundKiB(m.AgentPSSBytes)),
			units.FormatSize(roundKiB(m.CgroupBytes)), m.CreateRate)
	}
	return nil
}

func roundKiB(n int64) int64 { return n / 1024 * 1024 }

func benchRun(w io.Writer, g *globals, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cage := []string{exe, "--run-dir", g.runDir, "run", "--", "true"}
	bw, bwErr := bench.BwrapArgv("true")
	if bwErr != nil {
		s, err := bench.WholeProcess(cage, runs)
		if err != nil {
			return exitf(ExitInternal, "run: %v", err)
		}
		fmt.Fprintf(w, "cage run -- true (whole process)       %s\n  (no peer: %v)\n", s, bwErr)
		return nil
	}
	st, err := bench.Interleaved([][]string{cage, bw}, runs)
	if err != nil {
		return exitf(ExitInternal, "run: %v", err)
	}
	fmt.Fprintf(w, "cage run -- true (whole process)       %s\n", st[0])
	fmt.Fprintf(w, "bwrap --unshare-all true (peer)        %s\n", st[1])
	fmt.Fprintf(w, "ratio of medians cage/bwrap            %.2fx\n", stats.Ratio(st[0], st[1]))
	return nil
}

func benchServe(ctx context.Context, w io.Writer, runs, idle int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 4)
	if err != nil {
		return exitf(ExitInternal, "serve: %v", err)
	}
	defer d.Stop()
	c := d.Client()
	s, err := bench.TimeToInteractive(ctx, c, runs, 1)
	if err != nil {
		return exitf(ExitInternal, "serve: %v", err)
	}
	fmt.Fprintf(w, "serve: time to interactive, sequential  %s\n", s)
	s, err = bench.TimeToInteractive(ctx, c, max(runs, 40), 20)
	if err != nil {
		return exitf(ExitInternal, "serve: %v", err)
	}
	fmt.Fprintf(w, "serve: time to interactive, 20 at once  %s\n", s)
	s, err = bench.ProxyRoundTrip(ctx, c, max(runs, 200))
	if err != nil {
		return exitf(ExitInternal, "serve: %v", err)
	}
	fmt.Fprintf(w, "serve: round trip through the proxy     %s\n", s)
	rate, before, after, err := bench.DaemonLoad(ctx, d, idle, 4)
	if err != nil {
		return exitf(ExitInternal, "serve: %v", err)
	}
	fmt.Fprintf(w, "serve: %d sandboxes created through the API at %.1f/s; daemon RSS %s idle, %s with them alive\n",
		idle, rate, units.FormatSize(roundKiB(before)), units.FormatSize(roundKiB(after)))
	return nil
}

// benchMCP measures the MCP server's exec against the E2B protocol's.
func benchMCP(ctx context.Context, w io.Writer, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 1)
	if err != nil {
		return exitf(ExitInternal, "mcp: %v", err)
	}
	defer d.Stop()
	f, err := bench.MCPExec(ctx, exe, d, runs)
	if err != nil {
		return exitf(ExitInternal, "mcp: %v", err)
	}
	fmt.Fprintf(w, "mcp: exec round trip over stdio (cage mcp)          %s\n", f.Stdio)
	fmt.Fprintf(w, "mcp: exec round trip over streamable HTTP (/mcp)   %s\n", f.HTTP)
	fmt.Fprintf(w, "mcp: the same command through the E2B protocol     %s\n", f.E2B)
	fmt.Fprintf(w, "mcp: ratio of medians stdio/E2B %.2fx, HTTP/E2B %.2fx\n", stats.Ratio(f.Stdio, f.E2B), stats.Ratio(f.HTTP, f.E2B))
	return nil
}

// benchInterp measures the code interpreter through daemons it starts:
// one keeping a pool of started code-interpreter-v1 sandboxes, one
// without (every create starts its kernel).
func benchInterp(ctx context.Context, w io.Writer, h *sandbox.Host, runs int) error {
	if h.Templates == nil {
		var err error
		if h.Templates, err = openTemplates(""); err != nil {
			return err
		}
	}
	if _, err := h.Template(bench.InterpTemplate); err != nil {
		fmt.Fprintf(w, "interp: skipped: %v (make code-interpreter builds it)\n", err)
		return nil
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	for _, pooled := range []bool{true, false} {
		var extra []string
		if pooled {
			extra = []string{"--pool-of", bench.InterpTemplate + "=2"}
		}
		d, err := bench.StartDaemon(exe, 0, extra...)
		if err != nil {
			return exitf(ExitInternal, "interp: %v", err)
		}
		c := d.Client()
		// A pool of 2 refills one sandbox (its Python kernel) in about a
		// second here: the pause keeps samples apart from refills.
		pause := 100 * time.Millisecond
		if pooled {
			pause = 3 * time.Second
		}
		s, n, err := bench.InterpCreateToFirstResult(ctx, c, d.Proxy, runs, pause)
		if err != nil {
			d.Stop()
			return exitf(ExitInternal, "interp: %v", err)
		}
		if pooled {
			fmt.Fprintf(w, "interp: create -> first runCode('1+1'), pool of 2 started  %s (%d of %d from the pool)\n", s, n, s.N)
			rt, err := bench.InterpRoundTrip(ctx, c, d.Proxy, max(runs, 200))
			if err != nil {
				d.Stop()
				return exitf(ExitInternal, "interp: %v", err)
			}
			fmt.Fprintf(w, "interp: runCode('1+1') round trip in a live context  %s\n", rt)
		} else {
			fmt.Fprintf(w, "interp: create -> first runCode('1+1'), cold (kernel starts)  %s\n", s)
		}
		d.Stop()
	}
	return nil
}

// benchMicroVM measures the microvm wall: a create (restored from the
// snapshot of its shape, made by the warm-up) to first output, interleaved
// with the process wall's, and 20 idle VMs of one snapshot.
func benchMicroVM(ctx context.Context, w io.Writer, h *sandbox.Host, runs int) error {
	if err := h.WallMissing("microvm"); err != nil {
		fmt.Fprintf(w, "microvm: skipped: %v\n", err)
		return nil
	}
	if h.Templates == nil {
		var err error
		if h.Templates, err = openTemplates(""); err != nil {
			return err
		}
	}
	if warning := h.Warning(ctx, "microvm"); warning != "" {
		fmt.Fprintf(w, "microvm: %s\n", warning)
	}
	if _, err := bench.WallToFirstOutput(ctx, h, "microvm", 0, 2); err != nil {
		return exitf(ExitInternal, "microvm: %v", err)
	}
	var vms, procs []time.Duration
	for i := 0; i < runs; i++ { // interleaved: drift hits both alike
		v, err := bench.WallToFirstOutput(ctx, h, "microvm", 1, 0)
		if err != nil {
			return exitf(ExitInternal, "microvm: %v", err)
		}
		p, err := bench.WallToFirstOutput(ctx, h, "process", 1, 0)
		if err != nil {
			return exitf(ExitInternal, "process: %v", err)
		}
		vms, procs = append(vms, v.P50), append(procs, p.P50)
	}
	vs, ps := stats.Summarize(vms), stats.Summarize(procs)
	fmt.Fprintf(w, "microvm: create (restore) -> first output  %s\n", vs)
	fmt.Fprintf(w, "process: create -> first output            %s\n", ps)
	fmt.Fprintf(w, "microvm: ratio of medians microvm/process  %.1fx\n", stats.Ratio(vs, ps))
	m, err := bench.WallIdleMemory(ctx, h, "microvm", 20)
	if err != nil {
		return exitf(ExitInternal, "microvm memory: %v", err)
	}
	fmt.Fprintf(w, "microvm: 20 idle VMs of one snapshot: QEMU PSS %s, host cgroup charge %s, %s per VM (MemAvailable drop)\n",
		units.FormatSize(roundKiB(m.AgentPSSBytes)), units.FormatSize(roundKiB(m.CgroupBytes)), units.FormatSize(roundKiB(m.PerSandboxBytes)))
	return nil
}

func benchWalls(ctx context.Context, w io.Writer, h *sandbox.Host, runs int) error {
	for _, name := range []string{"runc", "gvisor"} {
		if err := h.WallMissing(name); err != nil {
			fmt.Fprintf(w, "%s: skipped: %v\n", name, err)
			continue
		}
		var cage, bare []time.Duration
		if _, err := bench.WallToFirstOutput(ctx, h, name, 0, 2); err != nil {
			return exitf(ExitInternal, "%s: %v", name, err)
		}
		if _, err := bench.BareToFirstOutput(ctx, h, name, 0, 2); err != nil {
			return exitf(ExitInternal, "%s bare: %v", name, err)
		}
		for i := 0; i < runs; i++ { // interleaved: drift hits both alike
			c, err := bench.WallToFirstOutput(ctx, h, name, 1, 0)
			if err != nil {
				return exitf(ExitInternal, "%s: %v", name, err)
			}
			b, err := bench.BareToFirstOutput(ctx, h, name, 1, 0)
			if err != nil {
				return exitf(ExitInternal, "%s bare: %v", name, err)
			}
			cage, bare = append(cage, c.P50), append(bare, b.P50)
		}
		cs, bs := stats.Summarize(cage), stats.Summarize(bare)
		fmt.Fprintf(w, "%s: cage create -> first output      %s\n", name, cs)
		fmt.Fprintf(w, "%s: the raw runtime running the same bundle  %s\n", name, bs)
		fmt.Fprintf(w, "%s: ratio of medians cage/raw         %.2fx\n", name, stats.Ratio(cs, bs))
		m, err := bench.WallIdleMemory(ctx, h, name, 50)
		if err != nil {
			return exitf(ExitInternal, "%s memory: %v", name, err)
		}
		fmt.Fprintf(w, "%s: 50 idle sandboxes: %s per sandbox (MemAvailable drop), init PSS %s, cgroup charge %s\n",
			name, units.FormatSize(roundKiB(m.PerSandboxBytes)), units.FormatSize(roundKiB(m.AgentPSSBytes)),
			units.FormatSize(roundKiB(m.CgroupBytes)))
	}
	return nil
}

// benchDurable measures pause and resume (with memory and with files only)
// with 64 MiB, 256 MiB and 1 GiB of touched memory, and a fork of 10 from
// one snapshot, on every wall this host has, through a daemon.
func benchDurable(ctx context.Context, w io.Writer, h *sandbox.Host, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 0)
	if err != nil {
		return exitf(ExitInternal, "durable: %v", err)
	}
	defer d.Stop()
	runs = max(1, min(runs, 5))
	for _, wall := range sandbox.Walls {
		if err := h.WallMissing(wall); err != nil {
			fmt.Fprintf(w, "durable %s: skipped: %v\n", wall, err)
			continue
		}
		template := h.DefaultTemplate(wall)
		for _, size := range []int64{64 << 20, 256 << 20, 1 << 30} {
			f, err := bench.Pause(ctx, d, wall, template, size, runs)
			if err != nil {
				fmt.Fprintf(w, "durable %s %s: %v\n", wall, units.FormatSize(size), err)
				continue
			}
			kept := "frozen"
			if f.PausedWith == "checkpoint" {
				kept = "checkpoint of " + units.FormatSize(roundKiB(f.CheckpointBytes)) + " on disk"
			}
			fmt.Fprintf(w, "durable %s, %s touched: pause (memory) %s, resume %s; paused (%s), it holds %s of host memory\n",
				wall, units.FormatSize(size), f.Pause, f.Resume, kept, units.FormatSize(roundKiB(f.PausedBytes)))
			fmt.Fprintf(w, "durable %s, %s touched: pause (files) %s, resume %s; its saved files %s, host memory 0\n",
				wall, units.FormatSize(size), f.PauseFiles, f.ResumeFiles, units.FormatSize(roundKiB(f.FilesBytes)))
		}
		s, err := bench.Fork(ctx, d.Client(), wall, template, 10, runs)
		if err != nil {
			fmt.Fprintf(w, "durable %s fork: %v\n", wall, err)
			continue
		}
		fmt.Fprintf(w, "durable %s: fork of 10 from one snapshot, to the first output of all  %s\n", wall, s)
	}
	fmt.Fprintln(w, "durable: E2B publishes about 4 s per GiB to pause and about 1 s to resume")
	return nil
}
