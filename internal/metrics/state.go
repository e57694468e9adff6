package metrics

import (
	"maps"
	"slices"
)

// State is what the daemon reads when Prometheus scrapes: each func is
// called once a scrape (nil: not shown).
type State struct {
	Sandboxes func() ([]SandboxGroup, error)
	Pools     func() []Pool
	Headroom  func() Headroom
	Teams     func() ([]TeamUse, error)
}

// SandboxGroup is how many sandboxes are in one state on one wall of one
// template ("snapshot" for those started from a snapshot).
type SandboxGroup struct {
	State, Wall, Template string
	N                     int
}

// Pool is one pool of prepared sandboxes.
type Pool struct {
	Template, Wall string
	Ready, Size    int
	Hits, Misses   int64
}

// Headroom is the host against what its sandboxes are given.
type Headroom struct {
	CPUs                         float64 // the host's
	MemTotal, MemAvailable       int64   // bytes (/proc/meminfo)
	CommittedCPUs                float64 // vCPUs of running sandboxes
	CommittedMemory              int64   // memory limits of running sandboxes and of those paused with their memory
	CommittedDisk                int64   // disk sizes of every sandbox
	DataFree, RunFree            int64   // bytes free where the data and run directories are
	MaxSandboxes, LiveSandboxes  int     // the server's bound, and the sandboxes it counts against it
	MaxCreating, CreatesInFlight int
}

// TeamUse is one team's quotas (0: none) and what it holds.
type TeamUse struct {
	Name         string
	Quota, Usage map[string]float64 // sandboxes, cpus, memory_bytes, disk_bytes, paused
}

// AddState adds what the daemon reads at each scrape.
func (m *Metrics) AddState(s State) {
	m.mu.Lock()
	m.states = append(m.states, s)
	m.mu.Unlock()
}

// families reads the state once: gauges and counters without their
// history, their series depending on what exists.
func (s State) families() []*family {
	var fams []*family
	fam := func(name, typ, help string) *family {
		f := &family{name: "cage_" + name, help: help, typ: typ}
		fams = append(fams, f)
		return f
	}
	if s.Sandboxes != nil {
		if gs, err := s.Sandboxes(); err == nil {
			f := fam("sandboxes", "gauge", "Sandboxes the daemon holds, by state, wall and template.")
			for _, g := range gs {
				f.add(float64(g.N), "state", g.State, "wall", g.Wall, "template", g.Template)
			}
		}
	}
	if s.Pools != nil {
		ready := fam("pool_ready", "gauge", "Prepared sandboxes ready in a pool.")
		size := fam("pool_size", "gauge", "How many sandboxes a pool keeps ready now (its size, more while creates find it empty).")
		hits := fam("pool_hits_total", "counter", "Creates a pool served.")
		misses := fam("pool_misses_total", "counter", "Creates that found their pool empty (and made a sandbox on the spot).")
		for _, p := range s.Pools() {
			ready.add(float64(p.Ready), "template", p.Template, "wall", p.Wall)
			size.add(float64(p.Size), "template", p.Template, "wall", p.Wall)
			hits.add(float64(p.Hits), "template", p.Template, "wall", p.Wall)
			misses.add(float64(p.Misses), "template", p.Template, "wall", p.Wall)
		}
	}
	if s.Headroom != nil {
		h := s.Headroom()
		fam("host_cpus", "gauge", "The host's CPUs.").add(h.CPUs)
		mem := fam("host_memory_bytes", "gauge", "The host's memory: total and available (/proc/meminfo MemAvailable).")
		mem.add(float64(h.MemTotal), "kind", "total")
		mem.add(float64(h.MemAvailable), "kind", "available")
		c := fam("sandboxes_committed", "gauge", "What the host has given its sandboxes: vCPUs (cpus), memory and disk limits (bytes).")
		c.add(h.CommittedCPUs, "resource", "cpus")
		c.add(float64(h.CommittedMemory), "resource", "memory_bytes")
		c.add(float64(h.CommittedDisk), "resource", "disk_bytes")
		free := fam("host_disk_free_bytes", "gauge", "Bytes free on the file systems of the data and run directories.")
		free.add(float64(h.DataFree), "dir", "data")
		free.add(float64(h.RunFree), "dir", "run")
		fam("sandboxes_max", "gauge", "The server's bound on sandboxes alive at once (max_sandboxes).").add(float64(h.MaxSandboxes))
		fam("sandboxes_live", "gauge", "Sandboxes counted against max_sandboxes (running, frozen, being made).").add(float64(h.LiveSandboxes))
		fam("creates_max", "gauge", "Creates the server runs at once (limits.creating).").add(float64(h.MaxCreating))
		fam("creates_in_flight", "gauge", "Creates running now.").add(float64(h.CreatesInFlight))
	}
	if s.Teams != nil {
		if ts, err := s.Teams(); err == nil {
			quota := fam("team_quota", "gauge", "A team's quota (absent: none): sandboxes, cpus, memory_bytes, disk_bytes, paused.")
			usage := fam("team_usage", "gauge", "What a team holds, in its quotas' terms.")
			for _, t := range ts {
				for _, r := range sortedKeys(t.Quota) {
					quota.add(t.Quota[r], "team", t.Name, "resource", r)
				}
				for _, r := range sortedKeys(t.Usage) {
					usage.add(t.Usage[r], "team", t.Name, "resource", r)
				}
			}
		}
	}
	return fams
}

func sortedKeys(m map[string]float64) []string {
	return slices.Sorted(maps.Keys(m))
}
