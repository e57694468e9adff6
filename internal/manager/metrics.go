package manager

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

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

// samples remembers the previous CPU reading per sandbox, so a sample's CPU
// percentage covers the time since the one before (or since creation).
var samples sync.Map // id -> cpuReading

type cpuReading struct {
	at    time.Time
	nanos uint64
}

// sampleStep is E2B's step between metric samples for ranges under an
// hour: its first sample of a sandbox exists once the sandbox has run that
// long, and until then it answers an empty list.
const sampleStep = 5 * time.Second

// Metrics samples a sandbox now, from its cgroup and its disk; none in its
// first sampleStep, as on E2B.
func (m *Manager) Metrics(keyID, id string) ([]Metric, error) {
	rec, err := m.Get(keyID, id)
	if err != nil {
		return nil, err
	}
	if time.Since(rec.StartedAt) < sampleStep {
		return []Metric{}, nil
	}
	sb, ok := m.tracked(id)
	if !ok {
		return []Metric{}, nil // paused with its files: nothing runs to measure
	}
	u, err := sb.Cgroup().Usage()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	prev := cpuReading{at: rec.StartedAt}
	if v, ok := samples.Load(id); ok {
		prev = v.(cpuReading)
	}
	samples.Store(id, cpuReading{at: now, nanos: u.CPUNanos})
	pct := 0.0
	if wall := now.Sub(prev.at); wall > 0 && rec.CPUs > 0 && u.CPUNanos >= prev.nanos {
		pct = float64(u.CPUNanos-prev.nanos) / float64(wall.Nanoseconds()) / rec.CPUs * 100
	}
	mt := Metric{Time: now, CPUCount: rec.CPUs, CPUUsedPct: min(pct, 100), MemUsed: u.MemoryBytes,
		MemTotal: u.MemoryLimit, MemCache: u.CacheBytes}
	// The sandbox's disk, seen through its agent's root.
	var st unix.Statfs_t
	if err := unix.Statfs(sb.DiskPath(), &st); err == nil {
		mt.DiskTotal = int64(st.Blocks) * st.Bsize
		mt.DiskUsed = int64(st.Blocks-st.Bfree) * st.Bsize
	}
	return []Metric{mt}, nil
}
