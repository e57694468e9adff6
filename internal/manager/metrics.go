package manager

import (
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/wall"
)

// Metrics over time, as E2B serves them: every running sandbox is sampled
// every sampleStep (its cgroup's CPU time and memory, its disk's usage),
// starting sampleStep after it started, so a sandbox younger than that has
// no sample and its series is an empty list. A paused sandbox is not
// sampled (nothing of it runs). The samples live in the daemon's memory,
// per sandbox, for as long as the sandbox does (paused included), in two
// rings of bounded size: the last hour at sampleStep, and one sample a
// minute for the day before it; older ones are dropped. A daemon that
// restarts starts the series again.

// Metric is one sample of a sandbox's use, as E2B reports it.
type Metric struct {
	Time       time.Time
	CPUCount   float64
	CPUUsedPct float64
	MemUsed    int64
	MemTotal   int64
	MemCache   int64
	DiskUsed   int64
	DiskTotal  int64
}

// sampleStep is E2B's step between metric samples for ranges under an
// hour.
const sampleStep = 5 * time.Second

// The rings: fineSamples at sampleStep (the last hour), coarseSamples at
// one a minute (the last 25 hours: the day before the fine ring's hour). A
// sample is 48 bytes: at most about 105 KiB a sandbox.
const (
	fineSamples   = int(time.Hour / sampleStep)
	coarseEvery   = int(time.Minute / sampleStep)
	coarseSamples = 25 * 60
)

// sample is a Metric as kept: its totals and CPU count are the series'.
type sample struct {
	at                  int64 // unix nanoseconds
	cpuPct              float32
	memUsed, memCache   int64
	diskUsed, diskTotal int64
}

// ring is a fixed-size buffer of samples, oldest overwritten.
type ring struct {
	buf  []sample
	next int
	full bool
}

func (r *ring) add(s sample, size int) {
	if r.buf == nil {
		r.buf = make([]sample, 0, min(size, 64))
	}
	if len(r.buf) < size {
		r.buf = append(r.buf, s)
		return
	}
	r.buf[r.next] = s
	r.next = (r.next + 1) % size
	r.full = true
}

// each calls f on the samples oldest first.
func (r *ring) each(f func(sample)) {
	if !r.full {
		for _, s := range r.buf {
			f(s)
		}
		return
	}
	for i := range r.buf {
		f(r.buf[(r.next+i)%len(r.buf)])
	}
}

// series is one sandbox's samples and what the next one needs.
type series struct {
	fine, coarse ring
	count        int       // samples taken
	due          time.Time // when the next is taken
	cpuAt        time.Time // the CPU reading the next percentage starts from
	cpuNanos     uint64
	cpus         float64
	memTotal     int64
	hits         limitHits // the cgroup's OOM kills and refused forks so far (audit.go)
}

// metricsTable holds every sandbox's series.
type metricsTable struct {
	mu       sync.Mutex
	series   map[string]*series
	once     sync.Once
	stopOnce sync.Once
	stop     chan struct{}
}

func (t *metricsTable) forget(id string) {
	t.mu.Lock()
	delete(t.series, id)
	t.mu.Unlock()
}

// startSampler starts the manager's sampler, once; Close stops it.
func (m *Manager) startSampler() {
	m.metrics.once.Do(func() {
		m.metrics.stop = make(chan struct{})
		go func() {
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
			for {
				select {
				case <-m.metrics.stop:
					return
				case now := <-tick.C:
					m.sampleAll(now)
				}
			}
		}()
	})
}

func (m *Manager) stopSampler() {
	m.metrics.once.Do(func() {}) // a sampler never started stays so
	m.metrics.stopOnce.Do(func() {
		if m.metrics.stop != nil {
			close(m.metrics.stop)
		}
	})
}

// sampleAll samples every tracked sandbox whose sample is due.
func (m *Manager) sampleAll(now time.Time) {
	type due struct {
		id     string
		sb     wall.Sandbox
		paused bool
	}
	m.mu.Lock()
	list := make([]due, 0, len(m.live))
	for id, e := range m.live {
		list = append(list, due{id, e.sb, e.isPaused()})
	}
	m.mu.Unlock()
	for _, d := range list {
		m.sampleOne(d.id, d.sb, d.paused, now)
	}
}

// sampleOne takes sandbox id's sample if it is due. While paused, only the
// CPU reading moves on, so the first sample after a resume covers running
// time alone.
func (m *Manager) sampleOne(id string, sb wall.Sandbox, paused bool, now time.Time) {
	t := &m.metrics
	t.mu.Lock()
	s := t.series[id]
	t.mu.Unlock()
	if s == nil {
		rec, err := m.cfg.Store.GetSandbox(id)
		if err != nil {
			return
		}
		s = newSeries(rec)
		t.mu.Lock()
		if t.series == nil {
			t.series = map[string]*series{}
		}
		if cur := t.series[id]; cur != nil {
			s = cur
		} else {
			t.series[id] = s
		}
		t.mu.Unlock()
	}
	t.mu.Lock()
	due := !now.Before(s.due)
	t.mu.Unlock()
	if !due && !paused {
		return // its cgroup is read only when a sample is due: every second for all of them grew with the live count
	}
	cg := sb.Cgroup()
	if cg == nil {
		return
	}
	u, err := cg.Usage()
	if err != nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if paused {
		s.cpuAt, s.cpuNanos, s.due = now, u.CPUNanos, now.Add(sampleStep)
		return
	}
	if now.Before(s.due) {
		return
	}
	pct := 0.0
	if wall := now.Sub(s.cpuAt); wall > 0 && s.cpus > 0 && u.CPUNanos >= s.cpuNanos {
		pct = float64(u.CPUNanos-s.cpuNanos) / float64(wall.Nanoseconds()) / s.cpus * 100
	}
	s.cpuAt, s.cpuNanos, s.due = now, u.CPUNanos, nextDue(s.due, now)
	m.checkLimitHits(id, &s.hits, cg, now)
	if u.MemoryLimit > 0 {
		s.memTotal = u.MemoryLimit
	}
	smp := sample{at: now.UnixNano(), cpuPct: float32(min(pct, 100)), memUsed: u.MemoryBytes, memCache: u.CacheBytes}
	var st unix.Statfs_t
	if err := unix.Statfs(sb.DiskPath(), &st); err == nil {
		smp.diskTotal = int64(st.Blocks) * st.Bsize
		smp.diskUsed = int64(st.Blocks-st.Bfree) * st.Bsize
	}
	s.fine.add(smp, fineSamples)
	if s.count%coarseEvery == 0 {
		s.coarse.add(smp, coarseSamples)
	}
	s.count++
}

// nextDue is when the sample after one due at due and taken at now is
// due: one step after this one was due, not after the tick that took it
// (late by up to a tick, more under load), so that samples stay sampleStep
// apart instead of drifting later each time; one step from now when the
// sampler fell a whole step behind.
func nextDue(due, now time.Time) time.Time {
	if next := due.Add(sampleStep); next.After(now) {
		return next
	}
	return now.Add(sampleStep)
}

// newSeries starts a sandbox's series: its first sample comes sampleStep
// after it started, with its CPU time since then.
func newSeries(rec *store.Sandbox) *series {
	return &series{due: rec.StartedAt.Add(sampleStep), cpuAt: rec.StartedAt, cpus: rec.CPUs, memTotal: rec.Memory,
		hits: limitHits{fresh: time.Since(rec.StartedAt) < 2*sampleStep}}
}

// Metrics returns a sandbox's samples taken between start and end
// (inclusive; zero times: from its start, until now), oldest first: the
// minute samples older than the last hour's, then those.
func (m *Manager) Metrics(keyID, id string, start, end time.Time) ([]Metric, error) {
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	if !start.IsZero() && !end.IsZero() && end.Before(start) {
		return nil, fmt.Errorf("%w: metrics range: end (%d) is before start (%d)", ErrInvalid, end.Unix(), start.Unix())
	}
	t := &m.metrics
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.series[id]
	out := []Metric{}
	if s == nil {
		return out, nil
	}
	from, to := int64(0), int64(1)<<62
	if !start.IsZero() {
		from = start.UnixNano()
	}
	if !end.IsZero() {
		to = end.Add(time.Second - 1).UnixNano() // the whole second end names
	}
	firstFine := int64(1) << 62
	s.fine.each(func(x sample) { firstFine = min(firstFine, x.at) })
	add := func(x sample) {
		if x.at < from || x.at > to {
			return
		}
		out = append(out, Metric{Time: time.Unix(0, x.at).UTC(), CPUCount: rec.CPUs, CPUUsedPct: float64(x.cpuPct),
			MemUsed: x.memUsed, MemTotal: s.memTotal, MemCache: x.memCache, DiskUsed: x.diskUsed, DiskTotal: x.diskTotal})
	}
	s.coarse.each(func(x sample) {
		if x.at < firstFine {
			add(x)
		}
	})
	s.fine.each(add)
	return out, nil
}
