package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
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

// stateCollector reads State at each scrape. It describes nothing ahead
// (an unchecked collector): its series depend on what exists.
type stateCollector struct{ s State }

// AddState adds the scrape-time readings.
func (m *Metrics) AddState(s State) { m.reg.MustRegister(stateCollector{s}) }

func (stateCollector) Describe(chan<- *prometheus.Desc) {}

var (
	descSandboxes   = desc("sandboxes", "Sandboxes the daemon holds, by state, wall and template.", "state", "wall", "template")
	descPoolReady   = desc("pool_ready", "Prepared sandboxes ready in a pool.", "template", "wall")
	descPoolSize    = desc("pool_size", "How many sandboxes a pool keeps ready now (its size, more while creates find it empty).", "template", "wall")
	descPoolHits    = desc("pool_hits_total", "Creates a pool served.", "template", "wall")
	descPoolMisses  = desc("pool_misses_total", "Creates that found their pool empty (and made a sandbox on the spot).", "template", "wall")
	descHostCPUs    = desc("host_cpus", "The host's CPUs.")
	descHostMem     = desc("host_memory_bytes", "The host's memory: total and available (/proc/meminfo MemAvailable).", "kind")
	descCommitted   = desc("sandboxes_committed", "What the host has given its sandboxes: vCPUs (cpus), memory and disk limits (bytes).", "resource")
	descFree        = desc("host_disk_free_bytes", "Bytes free on the file systems of the data and run directories.", "dir")
	descMaxSbx      = desc("sandboxes_max", "The server's bound on sandboxes alive at once (max_sandboxes).")
	descLiveSbx     = desc("sandboxes_live", "Sandboxes counted against max_sandboxes (running, frozen, being made).")
	descMaxCreating = desc("creates_max", "Creates the server runs at once (limits.creating).")
	descCreating    = desc("creates_in_flight", "Creates running now.")
	descTeamQuota   = desc("team_quota", "A team's quota (absent: none): sandboxes, cpus, memory_bytes, disk_bytes, paused.", "team", "resource")
	descTeamUsage   = desc("team_usage", "What a team holds, in its quotas' terms.", "team", "resource")
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("cage_"+name, help, labels, nil)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func counterOf(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	if c.s.Sandboxes != nil {
		if gs, err := c.s.Sandboxes(); err == nil {
			for _, g := range gs {
				gauge(ch, descSandboxes, float64(g.N), g.State, g.Wall, g.Template)
			}
		}
	}
	if c.s.Pools != nil {
		for _, p := range c.s.Pools() {
			gauge(ch, descPoolReady, float64(p.Ready), p.Template, p.Wall)
			gauge(ch, descPoolSize, float64(p.Size), p.Template, p.Wall)
			counterOf(ch, descPoolHits, float64(p.Hits), p.Template, p.Wall)
			counterOf(ch, descPoolMisses, float64(p.Misses), p.Template, p.Wall)
		}
	}
	if c.s.Headroom != nil {
		h := c.s.Headroom()
		gauge(ch, descHostCPUs, h.CPUs)
		gauge(ch, descHostMem, float64(h.MemTotal), "total")
		gauge(ch, descHostMem, float64(h.MemAvailable), "available")
		gauge(ch, descCommitted, h.CommittedCPUs, "cpus")
		gauge(ch, descCommitted, float64(h.CommittedMemory), "memory_bytes")
		gauge(ch, descCommitted, float64(h.CommittedDisk), "disk_bytes")
		gauge(ch, descFree, float64(h.DataFree), "data")
		gauge(ch, descFree, float64(h.RunFree), "run")
		gauge(ch, descMaxSbx, float64(h.MaxSandboxes))
		gauge(ch, descLiveSbx, float64(h.LiveSandboxes))
		gauge(ch, descMaxCreating, float64(h.MaxCreating))
		gauge(ch, descCreating, float64(h.CreatesInFlight))
	}
	if c.s.Teams != nil {
		if ts, err := c.s.Teams(); err == nil {
			for _, t := range ts {
				for r, v := range t.Quota {
					gauge(ch, descTeamQuota, v, t.Name, r)
				}
				for r, v := range t.Usage {
					gauge(ch, descTeamUsage, v, t.Name, r)
				}
			}
		}
	}
}
