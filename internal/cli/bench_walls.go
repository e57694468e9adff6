package cli

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

// benchWalls measures each OCI wall: create -> first output cold and from
// the wall's pool, each interleaved with the raw runtime running the same
// bundle, and memory with 50 idle sandboxes.
func benchWalls(ctx context.Context, t *bench.Table, g *globals, h *sandbox.Host, runs int) error {
	for _, name := range []string{"runc", "gvisor"} {
		if err := h.WallMissing(name); err != nil {
			for _, id := range []string{name, name + ".pool"} {
				t.Skip(id, "", err.Error())
			}
			continue
		}
		if _, err := bench.BareToFirstOutput(ctx, h, name, 0, 2); err != nil {
			t.Fail(name, "", fmt.Errorf("bare: %w", err))
			continue
		}
		cold := func() (time.Duration, error) {
			s, err := bench.WallToFirstOutput(ctx, h, name, 1, 0)
			return s.P50, err
		}
		if _, err := bench.WallToFirstOutput(ctx, h, name, 0, 2); err != nil {
			t.Fail(name, "", err)
		} else {
			wallRow(ctx, t, h, name, name, runs, nil, cold, 0)
		}
		benchWallPool(ctx, t, g, h, name, runs)
		m, err := bench.WallIdleMemory(ctx, h, name, 50)
		if err != nil {
			t.Fail(name+".memory", name+": host memory per idle sandbox, 50 alive", err)
			continue
		}
		t.Set(bench.Row{ID: name + ".memory", What: name + ": host memory per idle sandbox, 50 alive (MemAvailable drop)",
			Cage: perSandbox(m), Status: memStatus(m),
			Note: fmt.Sprintf("init PSS %s, cgroup charge %s", units.FormatSize(roundKiB(m.AgentPSSBytes)), units.FormatSize(roundKiB(m.CgroupBytes)))})
	}
	return nil
}

// wallRow fills row id with sample() interleaved with the raw runtime's
// create -> first output, the raw one first, each pair after settle (when
// not nil: a pool full again, so that its refill runs beside neither);
// target is the ratio of medians to meet (0: none).
func wallRow(ctx context.Context, t *bench.Table, h *sandbox.Host, id, name string, runs int, settle func() error,
	sample func() (time.Duration, error), target float64) {
	var cage, bare []time.Duration
	for i := 0; i < runs; i++ { // interleaved: drift hits both alike
		if settle != nil {
			if err := settle(); err != nil {
				t.Fail(id, "", err)
				return
			}
		}
		b, err := bench.BareToFirstOutput(ctx, h, name, 1, 0)
		if err != nil {
			t.Fail(id, "", fmt.Errorf("bare: %w", err))
			return
		}
		c, err := sample()
		if err != nil {
			t.Fail(id, "", err)
			return
		}
		cage, bare = append(cage, c), append(bare, b.P50)
	}
	cs, bs := stats.Summarize(cage), stats.Summarize(bare)
	r := stats.Ratio(cs, bs)
	st := bench.NoTarget
	if target > 0 {
		st = bench.Judge(r <= target)
	}
	t.Set(bench.Row{ID: id, Cage: bench.Latency(cs), Peer: bench.Latency(bs), Ratio: r, Status: st})
}

// benchWallPool measures a wall's pooled creates (pool of 4, full before
// each sample) against the raw runtime, where this build's walls keep
// pools (bench.WallPooler); else the row says why it is not measured.
func benchWallPool(ctx context.Context, t *bench.Table, g *globals, h *sandbox.Host, name string, runs int) {
	id := name + ".pool"
	pooled, err := pooledHost(g, h, name)
	if err != nil {
		t.Skip(id, "", err.Error())
		return
	}
	defer pooled.Close()
	var missed int64
	sample := func() (time.Duration, error) {
		s, m, err := bench.PooledToFirstOutput(ctx, pooled, name, 1, 0)
		missed += m
		return s.P50, err
	}
	full := func() error { _, err := bench.WaitPoolFull(ctx, pooled, name); return err }
	if _, _, err := bench.PooledToFirstOutput(ctx, pooled, name, 0, 2); err != nil {
		t.Fail(id, "", err)
		return
	}
	if name == "microvm" {
		s, m, err := bench.PooledToFirstOutput(ctx, pooled, name, runs, 0)
		if err != nil {
			t.Fail(id, "", err)
			return
		}
		t.Set(bench.Row{ID: id, Cage: bench.Latency(s), Status: bench.Judge(s.P50 <= 50*time.Millisecond), Note: poolNote(m)})
		return
	}
	wallRow(ctx, t, h, id, name, runs, full, sample, 1.0)
	if r, ok := t.Get(id); ok && missed > 0 {
		r.Note = poolNote(missed)
		t.Set(r)
	}
}

// pooledHost is a host of its own keeping a pool of 4 on wall name, with
// the template store of h.
func pooledHost(g *globals, h *sandbox.Host, name string) (*sandbox.Host, error) {
	pooled, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return nil, err
	}
	pooled.Templates = h.Templates
	p, ok := any(pooled).(bench.WallPooler)
	if !ok {
		pooled.Close()
		return nil, fmt.Errorf("this build keeps no pools on the %s wall", name)
	}
	if err := p.AddWallPool(name, pooled.DefaultTemplate(name), 4); err != nil {
		pooled.Close()
		return nil, fmt.Errorf("no pool on the %s wall: %v", name, err)
	}
	return pooled, nil
}

// benchMicroVM measures the microvm wall: a create (restored from the
// snapshot of its shape, made by the warm-up) to first output, interleaved
// with the process wall's, from a pool where the walls keep pools, and 20
// idle VMs of one snapshot.
func benchMicroVM(ctx context.Context, t *bench.Table, g *globals, h *sandbox.Host, runs int) error {
	if err := h.WallMissing("microvm"); err != nil {
		for _, id := range []string{"microvm", "microvm.pool"} {
			t.Skip(id, "", err.Error())
		}
		return nil
	}
	if h.Templates == nil {
		var err error
		if h.Templates, err = openTemplates(""); err != nil {
			return err
		}
	}
	warning := h.Warning(ctx, "microvm")
	if _, err := bench.WallToFirstOutput(ctx, h, "microvm", 0, 2); err != nil {
		t.Fail("microvm", "", err)
		return nil
	}
	var vms, procs []time.Duration
	var blocks []int
	for i := 0; i < runs; i++ { // interleaved: drift hits both alike
		v, b, err := bench.WallToFirstOutputBlocks(ctx, h, "microvm", 1, 0)
		if err != nil {
			t.Fail("microvm", "", err)
			return nil
		}
		blocks = append(blocks, b...)
		p, err := bench.WallToFirstOutput(ctx, h, "process", 1, 0)
		if err != nil {
			t.Fail("microvm", "", fmt.Errorf("process: %w", err))
			return nil
		}
		vms, procs = append(vms, v.P50), append(procs, p.P50)
	}
	vs, ps := stats.Summarize(vms), stats.Summarize(procs)
	t.Set(bench.Row{ID: "microvm", Cage: bench.Latency(vs), Peer: bench.Latency(ps), Ratio: stats.Ratio(vs, ps),
		Status: bench.Judge(vs.P50 <= 300*time.Millisecond), Note: joinNotes(warning, blocksNote(blocks))})
	benchWallPool(ctx, t, g, h, "microvm", runs)
	m, err := bench.WallIdleMemory(ctx, h, "microvm", 20)
	if err != nil {
		t.Fail("microvm.memory", "microvm: 20 idle VMs of one snapshot", err)
		return nil
	}
	t.Set(bench.Row{ID: "microvm.memory", What: "microvm: host memory per idle VM, 20 of one snapshot (MemAvailable drop)",
		Cage: perSandbox(m), Status: memStatus(m),
		Note: fmt.Sprintf("QEMU PSS %s, host cgroup charge %s", units.FormatSize(roundKiB(m.AgentPSSBytes)), units.FormatSize(roundKiB(m.CgroupBytes)))})
	return nil
}

// perSandbox is a memory measurement's MemAvailable drop per sandbox.
func perSandbox(m bench.Memory) *bench.Figure {
	return bench.Quantity(float64(m.PerSandboxBytes)/(1<<20), "MiB")
}

// memStatus marks a drop of MemAvailable that is no drop: memory freed
// elsewhere on the host meanwhile outweighed the sandboxes'.
func memStatus(m bench.Memory) bench.Status {
	if m.PerSandboxBytes <= 0 {
		return bench.NotMeasured
	}
	return bench.NoTarget
}

// blocksNote says how many blocks of guest code a restored microVM's QEMU
// translated to the end of its first command (the median of the samples;
// "" where none was read, as under KVM): under TCG each is the first run
// of its code, and the count, unlike the time, does not move with the
// host's load (docs/BENCHMARKS.md).
func blocksNote(blocks []int) string {
	if len(blocks) == 0 {
		return ""
	}
	b := slices.Clone(blocks)
	slices.Sort(b)
	return fmt.Sprintf("TCG translated %d blocks of guest code from the restore to the end of echo (median of %d)", b[len(b)/2], len(b))
}

// joinNotes joins a row's notes, leaving out the empty ones.
func joinNotes(notes ...string) string {
	var kept []string
	for _, n := range notes {
		if n != "" {
			kept = append(kept, n)
		}
	}
	return strings.Join(kept, "; ")
}
