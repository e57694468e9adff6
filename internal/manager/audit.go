package manager

import (
	"os"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/network"
)

// The manager's entries in the audit trail (Config.Audit; nil: none):
// each sandbox's lifecycle as the host carries it out, its network
// decisions and its out-of-memory and pids-limit kills (read from its
// host cgroup's counters), volumes made and deleted.

// event records a lifecycle entry of a sandbox; key "" lets the trail find
// the sandbox's owner.
func (m *Manager) event(id, key, kind string, detail map[string]any) {
	m.cfg.Audit.Record(audit.Event{Kind: kind, KeyID: key, SandboxID: id, Detail: detail})
	m.changed(id, kind)
	switch kind {
	case audit.KindKill, audit.KindDied, audit.KindRemoved:
		m.cfg.Metrics.Ended(strings.TrimPrefix(kind, "sandbox."))
	case audit.KindTimeout:
		if detail["action"] != "paused" {
			m.cfg.Metrics.Ended("timeout")
		}
	}
}

// changed tells Config.Changed of a change to sandbox id.
func (m *Manager) changed(id, kind string) {
	if m.cfg.Changed != nil && strings.HasPrefix(kind, "sandbox.") {
		m.cfg.Changed(id, kind)
	}
}

// endKind is the kind of entry that ends a sandbox, from why it ends.
func endKind(why string) string {
	switch {
	case strings.HasPrefix(why, "timed out"):
		return audit.KindTimeout
	case strings.HasPrefix(why, "died"):
		return audit.KindDied
	}
	return audit.KindKill
}

// netEvent records a network decision the network's log or resolver made
// for a sandbox.
func (m *Manager) netEvent(r network.Record) {
	kind := audit.KindNetConnect
	if r.Kind == "dns" {
		kind = audit.KindNetDNS
	}
	d := map[string]any{"decision": r.Decision}
	for k, v := range map[string]string{"proto": r.Proto, "dest": r.Dest, "name": r.Name, "qtype": r.QType, "detail": r.Detail} {
		if v != "" {
			d[k] = v
		}
	}
	m.cfg.Audit.Record(audit.Event{Time: r.Time, Kind: kind, SandboxID: r.Sandbox, Detail: d})
}

// Owner is the key a sandbox belongs to ("" when there is no such
// sandbox): the trail's way to fill in entries recorded without one.
func (m *Manager) Owner(id string) string {
	rec, err := m.cfg.Store.GetSandbox(id)
	if err != nil {
		return ""
	}
	return rec.KeyID
}

// limitHits are a sandbox's cgroup counters of limit hits as last read.
type limitHits struct {
	read       bool
	fresh      bool // the sandbox started just now: its counters start at zero
	oom, forks uint64
}

// checkLimitHits reads a sandbox's host cgroup counters (the OOM killer's
// kills, forks the pids limit refused) and records what they gained. A
// sandbox the daemon adopted or resumed starts from what they hold.
func (m *Manager) checkLimitHits(id string, h *limitHits, cg *cgroups.Cgroup, now time.Time) {
	oom, forks := readCounter(cg.OOMEventsFile(), "oom_kill"), readCounter(cg.PidsEventsFile(), "max")
	if !h.read && !h.fresh {
		h.oom, h.forks = oom, forks
	}
	h.read = true
	if h.oom < oom {
		m.cfg.Metrics.LimitHits("oom", oom-h.oom)
	}
	if h.forks < forks {
		m.cfg.Metrics.LimitHits("pids", forks-h.forks)
	}
	if oom > h.oom {
		m.cfg.Audit.Record(audit.Event{Time: now, Kind: audit.KindOOM, SandboxID: id,
			Detail: map[string]any{"oom_kills": oom - h.oom, "total": oom, "observed": "the sandbox's host cgroup"}})
	}
	if forks > h.forks {
		m.cfg.Audit.Record(audit.Event{Time: now, Kind: audit.KindPidsMax, SandboxID: id,
			Detail: map[string]any{"forks_refused": forks - h.forks, "total": forks, "observed": "the sandbox's host cgroup"}})
	}
	h.oom, h.forks = max(h.oom, oom), max(h.forks, forks)
}

// readCounter reads a "key N" line of a cgroup event file (0 when absent).
func readCounter(path, key string) uint64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	return cgroups.Counter(f, key)
}
