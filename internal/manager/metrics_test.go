package manager

import (
	"errors"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

func newMetricsManager(t *testing.T) (*Manager, *store.Sandbox) {
	t.Helper()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	start := time.Now().Add(-30 * time.Hour)
	rec := &store.Sandbox{ID: "00000000000000000e70", KeyID: "k", State: store.StateRunning, CPUs: 2, Memory: 256 << 20,
		StartedAt: start, EndAt: start.Add(48 * time.Hour), NetSlot: -1}
	if err := st.InsertSandbox(rec); err != nil {
		t.Fatal(err)
	}
	return New(Config{Store: st}), rec
}

// fill puts n samples in the sandbox's series, one every sampleStep from
// its start, as the sampler would.
func fill(m *Manager, rec *store.Sandbox, n int) time.Time {
	s := newSeries(rec)
	at := rec.StartedAt
	for i := 0; i < n; i++ {
		at = at.Add(sampleStep)
		smp := sample{at: at.UnixNano(), cpuPct: float32(i % 100), memUsed: int64(i)}
		s.fine.add(smp, fineSamples)
		if s.count%coarseEvery == 0 {
			s.coarse.add(smp, coarseSamples)
		}
		s.count++
	}
	m.metrics.series = map[string]*series{rec.ID: s}
	return at
}

// A sandbox that lives longer than the rings holds: memory stays bounded
// (an hour of 5 s samples, a day of minute samples), the series is oldest
// first without gaps or repeats, at 1 min and then 5 s steps.
func TestMetricsBounded(t *testing.T) {
	m, rec := newMetricsManager(t)
	last := fill(m, rec, int(30*time.Hour/sampleStep))
	s := m.metrics.series[rec.ID]
	if len(s.fine.buf) != fineSamples || len(s.coarse.buf) != coarseSamples {
		t.Fatalf("after 30 h of samples the rings hold %d and %d, want %d and %d", len(s.fine.buf), len(s.coarse.buf), fineSamples, coarseSamples)
	}
	all, err := m.Metrics("k", rec.ID, time.Time{}, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if want := fineSamples + 24*60; len(all) > want+1 || len(all) < want-1 {
		t.Errorf("%d samples, want about %d (an hour at 5 s, a day at 1 min)", len(all), want)
	}
	if got := all[len(all)-1].Time; !got.Equal(last.UTC()) {
		t.Errorf("newest sample at %v, want %v", got, last)
	}
	if first := all[0].Time; last.Sub(first) > 25*time.Hour+time.Minute || last.Sub(first) < 24*time.Hour {
		t.Errorf("oldest sample %v before the newest, want a day and an hour", last.Sub(first))
	}
	for i := 1; i < len(all); i++ {
		step := all[i].Time.Sub(all[i-1].Time)
		if step <= 0 || step > time.Minute {
			t.Fatalf("samples %d and %d are %v apart", i-1, i, step)
		}
		if all[i].CPUCount != 2 || all[i].MemTotal != 256<<20 {
			t.Fatalf("sample %+v: want cpuCount 2 and memTotal 256 MiB", all[i])
		}
	}
}

// start and end bound the series (end's whole second included); end
// before start is ErrInvalid; another key's sandbox, or none, ErrNotFound;
// a sandbox without samples, an empty list.
func TestMetricsRange(t *testing.T) {
	m, rec := newMetricsManager(t)
	if got, err := m.Metrics("k", rec.ID, time.Time{}, time.Time{}); err != nil || got == nil || len(got) != 0 {
		t.Errorf("no samples yet: %v, %v; want an empty list", got, err)
	}
	last := fill(m, rec, 100)
	from := last.Add(-10 * sampleStep).Truncate(time.Second)
	got, err := m.Metrics("k", rec.ID, from, last.Truncate(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 11 || got[0].Time.Before(from) || got[len(got)-1].Time.After(last) {
		t.Errorf("the last 10 steps: %d samples from %v to %v", len(got), got[0].Time, got[len(got)-1].Time)
	}
	if got, _ := m.Metrics("k", rec.ID, last.Add(time.Hour), time.Time{}); len(got) != 0 {
		t.Errorf("a range after the newest sample: %d samples", len(got))
	}
	if _, err := m.Metrics("k", rec.ID, last, last.Add(-time.Second)); !errors.Is(err, ErrInvalid) {
		t.Errorf("end before start: %v, want ErrInvalid", err)
	}
	if _, err := m.Metrics("other", rec.ID, time.Time{}, time.Time{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("another key's sandbox: %v, want ErrNotFound", err)
	}
	if _, err := m.Metrics("k", "nosuch", time.Time{}, time.Time{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("no such sandbox: %v, want ErrNotFound", err)
	}
	m.metrics.forget(rec.ID)
	if got, _ := m.Metrics("k", rec.ID, time.Time{}, time.Time{}); len(got) != 0 {
		t.Errorf("after forget: %d samples", len(got))
	}
}

// countingSandbox counts the reads of its cgroup.
type countingSandbox struct {
	wall.Sandbox
	reads int
}

func (c *countingSandbox) Cgroup() *cgroups.Cgroup { c.reads++; return nil }

// TestSampleOnlyWhenDue: the sampler ticks every second, but a running
// sandbox's cgroup is read only when its sample is due (every sampleStep):
// reading all of them every tick cost the daemon CPU in proportion to the
// sandboxes alive. A paused one's CPU reading still moves on every tick.
func TestSampleOnlyWhenDue(t *testing.T) {
	m, rec := newMetricsManager(t)
	sb := &countingSandbox{}
	due := rec.StartedAt.Add(sampleStep)
	for at := rec.StartedAt.Add(time.Second); at.Before(due); at = at.Add(time.Second) {
		m.sampleOne(rec.ID, sb, false, at)
	}
	if sb.reads != 0 {
		t.Errorf("the cgroup was read %d times before the first sample was due", sb.reads)
	}
	m.sampleOne(rec.ID, sb, true, due.Add(-time.Second))
	if sb.reads != 1 {
		t.Errorf("a paused sandbox's cgroup was read %d times on a tick, want 1 (its CPU reading moves on)", sb.reads)
	}
	m.sampleOne(rec.ID, sb, false, due)
	if sb.reads != 2 {
		t.Errorf("the cgroup was read %d times in all once the sample was due, want 2", sb.reads)
	}
}

// TestSamplesDoNotDrift: with every tick late by most of a second, samples
// stay sampleStep apart (getMetrics over 12 s held one sample where two
// were due, on a loaded host); a sampler a whole step behind starts over.
func TestSamplesDoNotDrift(t *testing.T) {
	start := time.Unix(1_700_000_000, 0)
	due := start.Add(sampleStep)
	for i := 1; i <= 100; i++ {
		due = nextDue(due, due.Add(900*time.Millisecond))
		if want := start.Add(time.Duration(i+1) * sampleStep); !due.Equal(want) {
			t.Fatalf("sample %d due at +%v, want +%v", i+1, due.Sub(start), want.Sub(start))
		}
	}
	late := due.Add(3 * sampleStep)
	if got := nextDue(due, late); !got.Equal(late.Add(sampleStep)) {
		t.Errorf("a sampler 3 steps behind: next due +%v after the tick, want +%v", got.Sub(late), sampleStep)
	}
}
