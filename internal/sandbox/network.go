package sandbox

import (
	"fmt"
	"sync"

	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// networks owns the host's sandbox network, set up at the first sandbox
// that has one (or that a GC needs to clean after).
type networks struct {
	mu  sync.Mutex
	net *network.Host
}

// get returns the host's sandbox network when p needs one, setting it up
// the first time.
func (ns *networks) get(h *Host, p network.Policy) (*network.Host, error) {
	if !p.Networked() {
		return nil, nil
	}
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.net != nil {
		return ns.net, nil
	}
	cfg := h.NetConfig
	if cfg.Log == nil {
		cfg.Log = h.Log
	}
	if cfg.LockDir == "" {
		cfg.LockDir = h.RunDir
	}
	n, err := network.NewHost(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: sandbox network: %v", ErrUnavailable, err)
	}
	if removed := n.GC(state.SlotHeld); len(removed) > 0 {
		h.Log.Info("gc: removed the network of dead sandboxes", "slots", removed)
	}
	ns.net = n
	return n, nil
}

// current is the network, nil until a sandbox had one.
func (ns *networks) current() *network.Host {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return ns.net
}

// gc removes the network leftovers of dead sandboxes. A process that died
// with networked sandboxes left interfaces or rules behind: where this one
// has no network yet, setting it up collects them.
func (ns *networks) gc(h *Host) {
	if n := ns.current(); n != nil {
		if removed := n.GC(state.SlotHeld); len(removed) > 0 {
			h.Log.Info("gc: removed the network of dead sandboxes", "slots", removed)
		}
		return
	}
	if networkLeftovers() {
		if _, err := ns.get(h, network.Policy{Mode: network.Internet}); err != nil {
			h.Log.Warn("gc: sandbox network", "err", err)
		}
	}
}

func (ns *networks) close() {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.net != nil {
		ns.net.Close()
		ns.net = nil
	}
}

// networkLeftovers reports interfaces or nftables rules of sandbox slots
// that no live sandbox holds.
func networkLeftovers() bool {
	slots, _ := network.TableSlots()
	seen := map[int]bool{}
	for _, slot := range append(slots, network.HostLinks()...) {
		if seen[slot] {
			continue // a slot with rules and a link is asked about once
		}
		seen[slot] = true
		if !state.SlotHeld(slot) {
			return true
		}
	}
	return false
}

// Network is the host's sandbox network, nil until a sandbox had one.
func (h *Host) Network() *network.Host { return h.net.current() }

// AdoptNetwork takes over the network of an adopted sandbox (slot and
// policy as recorded when it was made).
func (h *Host) AdoptNetwork(sb wall.Sandbox, slot int, p network.Policy) error {
	n, err := h.net.get(h, p)
	if err != nil {
		return err
	}
	s, ok := sb.(wall.Networked)
	if !ok {
		return fmt.Errorf("sandbox %s: wall %s cannot adopt a network", sb.ID(), sb.Wall())
	}
	ns, err := n.Adopt(sb.ID(), slot, p)
	if err != nil {
		return fmt.Errorf("sandbox %s: network: %w", sb.ID(), err)
	}
	s.SetNetwork(ns)
	return nil
}
