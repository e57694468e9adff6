package cli

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

// benchMCP measures the MCP server's exec against the E2B protocol's.
func benchMCP(ctx context.Context, t *bench.Table, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 1)
	if err != nil {
		return err
	}
	defer d.Stop()
	f, err := bench.MCPExec(ctx, exe, d, runs)
	if err != nil {
		return err
	}
	peer := "the same command through the E2B protocol"
	t.Set(bench.Row{ID: "mcp.stdio", What: "mcp: exec round trip over stdio (cage mcp)", Cage: bench.Latency(f.Stdio),
		PeerName: peer, Peer: bench.Latency(f.E2B), Ratio: stats.Ratio(f.Stdio, f.E2B), Status: bench.NoTarget})
	t.Set(bench.Row{ID: "mcp.http", What: "mcp: exec round trip over streamable HTTP (/mcp)", Cage: bench.Latency(f.HTTP),
		PeerName: peer, Peer: bench.Latency(f.E2B), Ratio: stats.Ratio(f.HTTP, f.E2B), Status: bench.NoTarget})
	return nil
}

// benchInterp measures the code interpreter through daemons it starts:
// one keeping a pool of started code-interpreter-v1 sandboxes, one
// without (every create starts its kernel).
func benchInterp(ctx context.Context, t *bench.Table, h *sandbox.Host, runs int) error {
	if ok, err := haveTemplate(t, h, bench.InterpTemplate, "interp", "interp: the code interpreter", "make code-interpreter builds it"); !ok {
		return err
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
			return err
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
			return err
		}
		if pooled {
			t.Set(bench.Row{ID: "interp.pool", What: "interp: create -> first runCode('1+1'), pool of 2 started", Cage: bench.Latency(s),
				Status: bench.NoTarget, Note: fmt.Sprintf("%d of %d from the pool", n, s.N)})
			rt, err := bench.InterpRoundTrip(ctx, c, d.Proxy, max(runs, 200))
			if err != nil {
				d.Stop()
				return err
			}
			t.Set(bench.Row{ID: "interp.roundtrip", What: "interp: runCode('1+1') round trip in a live context", Cage: bench.Latency(rt), Status: bench.NoTarget})
		} else {
			t.Set(bench.Row{ID: "interp.cold", What: "interp: create -> first runCode('1+1'), cold (kernel starts)", Cage: bench.Latency(s), Status: bench.NoTarget})
		}
		d.Stop()
	}
	return nil
}

// benchDurable measures pause and resume (with memory and with files only)
// with 64 MiB, 256 MiB and 1 GiB of touched memory, and a fork of 10 from
// one snapshot, on every wall this host has, through a daemon.
func benchDurable(ctx context.Context, t *bench.Table, h *sandbox.Host, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 0)
	if err != nil {
		return err
	}
	defer d.Stop()
	runs = max(1, min(runs, 5))
	const peer = "E2B publishes about 4 s per GiB to pause and about 1 s to resume"
	for _, wall := range sandbox.Walls {
		id := "durable." + wall
		if err := h.WallMissing(wall); err != nil {
			t.Skip(id, "durable "+wall, err.Error())
			continue
		}
		template := h.DefaultTemplate(wall)
		for _, size := range []int64{64 << 20, 256 << 20, 1 << 30} {
			sid := fmt.Sprintf("%s.%dm", id, size>>20)
			what := fmt.Sprintf("durable %s, %s touched", wall, units.FormatSize(size))
			f, err := bench.Pause(ctx, d, wall, template, size, runs)
			if err != nil {
				t.Fail(sid, what, err)
				continue
			}
			kept := "frozen"
			if f.PausedWith == "checkpoint" {
				kept = "checkpoint of " + units.FormatSize(roundKiB(f.CheckpointBytes)) + " on disk"
			}
			t.Set(bench.Row{ID: sid + ".pause", What: what + ": pause (memory)", Cage: bench.Latency(f.Pause), PeerName: peer, Status: bench.NoTarget,
				Note: fmt.Sprintf("paused (%s), it holds %s of host memory", kept, units.FormatSize(roundKiB(f.PausedBytes)))})
			t.Set(bench.Row{ID: sid + ".resume", What: what + ": resume (memory)", Cage: bench.Latency(f.Resume), Status: bench.NoTarget})
			t.Set(bench.Row{ID: sid + ".pause-files", What: what + ": pause (files)", Cage: bench.Latency(f.PauseFiles), Status: bench.NoTarget,
				Note: "its saved files " + units.FormatSize(roundKiB(f.FilesBytes)) + ", host memory 0"})
			t.Set(bench.Row{ID: sid + ".resume-files", What: what + ": resume (files)", Cage: bench.Latency(f.ResumeFiles), Status: bench.NoTarget})
		}
		s, err := bench.Fork(ctx, d.Client(), wall, template, 10, runs)
		if err != nil {
			t.Fail(id+".fork", "durable "+wall+": fork", err)
			continue
		}
		t.Set(bench.Row{ID: id + ".fork", What: "durable " + wall + ": fork of 10 from one snapshot, to the first output of all", Cage: bench.Latency(s), Status: bench.NoTarget})
	}
	return nil
}

// haveTemplate opens the host's template store if it has none and says
// whether template name is in it; when it is not, the table's row id is
// skipped saying so, with how to build it.
func haveTemplate(t *bench.Table, h *sandbox.Host, name, id, what, build string) (bool, error) {
	if h.Templates == nil {
		var err error
		if h.Templates, err = openTemplates(""); err != nil {
			return false, err
		}
	}
	if _, err := h.Template(name); err != nil {
		t.Skip(id, what, fmt.Sprintf("%v (%s)", err, build))
		return false, nil
	}
	return true, nil
}
