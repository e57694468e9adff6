// Package network gives sandboxes a network the host controls. A sandbox
// with a network has a veth pair into its network namespace; what it may
// reach is decided outside the wall, by nftables rules on the host and by a
// resolver on the host that answers only the names its policy allows. Cloud
// metadata, the host itself, other sandboxes and private ranges are denied
// in every mode. Every wall uses it: the process and runc walls join the
// veth to the sandbox's own namespace, gVisor to a namespace made for it
// beforehand (its netstack takes the interface over).
package network

import (
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultSubnet holds the sandboxes' addresses: the gateway is its first
// address, sandbox slot N has address 256+N.
var DefaultSubnet = netip.MustParsePrefix("10.209.0.0/16")

// maxSlots is how many sandbox slots there are (state's uid-range slots).
const maxSlots = 4096

// Config is a host's network configuration.
type Config struct {
	Subnet netip.Prefix // sandbox addresses; DefaultSubnet when zero
	// Upstreams are the resolvers allowed names are asked of (host:port);
	// the host's /etc/resolv.conf when empty.
	Upstreams []string
	// Open are always-denied ranges the operator allows (e.g. a company
	// network); the sandbox subnet stays denied.
	Open []netip.Prefix
	// Record receives every connection and DNS decision (may be nil).
	Record func(Record)
	// LockDir holds the host-wide lock for creating the nftables table.
	LockDir string
	Log     *slog.Logger
}

// Record is one allowed or denied connection or DNS answer.
type Record struct {
	Time     time.Time `json:"time"`
	Sandbox  string    `json:"sandbox"`
	Kind     string    `json:"kind"` // "connect" or "dns"
	Decision string    `json:"decision"`
	Proto    string    `json:"proto,omitempty"`
	Dest     string    `json:"dest,omitempty"` // address:port
	Name     string    `json:"name,omitempty"`
	QType    string    `json:"qtype,omitempty"`
	Detail   string    `json:"detail,omitempty"`
}

// Host is this process's share of the host's sandbox network.
type Host struct {
	cfg     Config
	gateway netip.Addr
	denied  []span
	nft     *nft
	res     *resolver
	flog    *nflog
	log     *slog.Logger

	names     nameCache     // denied names' addresses
	stop      chan struct{} // ends the refresher of denied names
	closeOnce sync.Once

	mu     sync.Mutex
	bySlot map[int]*Sandbox
	byIP   map[netip.Addr]*Sandbox
}

// NewHost sets the host up for sandbox networks: forwarding on, the
// nftables table, a resolver and a log reader of this process's own, and
// the refresher of denied names' addresses. Where forwarding was off, the
// host routed nothing: the table then drops forwarded traffic that is not
// a sandbox's (see nftbase.go), so that turning it on routes nothing else.
func NewHost(cfg Config) (*Host, error) {
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = DefaultSubnet
	}
	if !cfg.Subnet.Addr().Is4() || cfg.Subnet.Bits() > 19 {
		return nil, fmt.Errorf("%w: sandbox subnet %s: want an IPv4 prefix of /19 or larger (%d slots)", ErrPolicy, cfg.Subnet, maxSlots)
	}
	cfg.Subnet = cfg.Subnet.Masked()
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.LockDir == "" {
		cfg.LockDir = "/run/cage"
	}
	if len(cfg.Upstreams) == 0 {
		cfg.Upstreams = HostResolvers("/etc/resolv.conf")
	}
	h := &Host{cfg: cfg, gateway: cfg.Subnet.Addr().Next(), denied: deniedSpans(cfg.Open, cfg.Subnet), log: cfg.Log,
		bySlot: map[int]*Sandbox{}, byIP: map[netip.Addr]*Sandbox{}, stop: make(chan struct{})}
	var err error
	if h.nft, err = newNFT(); err != nil {
		return nil, err
	}
	unlock, err := lockHost(cfg.LockDir)
	if err != nil {
		h.nft.close()
		return nil, err
	}
	// The log group first: the table has a log chain for it.
	if h.flog, err = openLog(h.logged); err != nil {
		unlock()
		h.nft.close()
		return nil, err
	}
	turnedOn, err := enableForwarding()
	if err == nil {
		err = h.nft.ensureBase(turnedOn, h.flog.group, h.denied)
	}
	unlock()
	if err != nil {
		h.flog.close()
		h.nft.close()
		return nil, err
	}
	if h.res, err = startResolver(h, cfg.Upstreams); err != nil {
		h.nft.closeOwner()
		h.flog.close()
		h.nft.close()
		return nil, err
	}
	go h.refreshDenied(h.stop)
	return h, nil
}

// enableForwarding turns IPv4 forwarding on and says whether it was off.
func enableForwarding() (turnedOn bool, err error) {
	const knob = "/proc/sys/net/ipv4/ip_forward"
	b, err := os.ReadFile(knob)
	if err != nil {
		return false, fmt.Errorf("IPv4 forwarding: %w", err)
	}
	if strings.TrimSpace(string(b)) == "1" {
		return false, nil
	}
	if err := os.WriteFile(knob, []byte("1"), 0); err != nil {
		return false, fmt.Errorf("enable IPv4 forwarding: %w", err)
	}
	return true, nil
}

// lockHost serialises the creation of the shared table between processes.
func lockHost(dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, "network.lock"), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// Close stops the resolver and the log reader. Sandboxes keep their rules
// (a process that adopts them takes them over); Sandbox.Close removes them.
func (h *Host) Close() {
	h.closeOnce.Do(func() {
		close(h.stop)
		h.nft.closeOwner()
		h.flog.close()
		h.res.close()
		h.nft.close()
	})
}

// Gateway is the address sandboxes reach the host's resolver at.
func (h *Host) Gateway() netip.Addr { return h.gateway }

// IP is the address of the sandbox in slot.
func (h *Host) IP(slot int) netip.Addr {
	return addr(u32(h.cfg.Subnet.Addr()) + 256 + uint32(slot))
}

// ResolvConf is the resolv.conf of a sandbox with a network.
func (h *Host) ResolvConf() string {
	return fmt.Sprintf("# cage: the host's resolver answers the names this sandbox may reach\nnameserver %s\noptions ndots:1 timeout:2 attempts:2\n", h.gateway)
}

// Attach gives sandbox id (holding uid slot) a network: rules first, so that
// nothing passes before they exist, then the veth into the namespace nsFD.
func (h *Host) Attach(id string, slot int, nsFD int, p Policy) (*Sandbox, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if !p.Networked() {
		return nil, fmt.Errorf("%w: mode %s has no network to attach", ErrPolicy, p.Mode)
	}
	if slot < 0 || slot >= maxSlots {
		return nil, fmt.Errorf("sandbox slot %d out of range", slot)
	}
	sb := newSandbox(h, id, slot, p)
	leftover, err := sb.start()
	if err != nil {
		_ = h.nft.remove(slot)
		return nil, err
	}
	// The slot's last holder died without its Close (a cage run killed, a
	// daemon crashed), and no GC has removed its rules: what it left
	// tracked is never this one's. (A Close and a GC forget it; walking
	// the host's connection table costs some 10 ms, so not on every
	// create.)
	if leftover {
		if err := forgetFlows(sb.IP); err != nil {
			_ = h.nft.remove(slot)
			return nil, err
		}
	}
	if sb.link, err = attachLink(slot, nsFD, sb.IP, h.gateway); err != nil {
		_ = h.nft.remove(slot)
		return nil, err
	}
	if sb.ns, err = unix.FcntlInt(uintptr(nsFD), unix.F_DUPFD_CLOEXEC, 3); err != nil {
		sb.ns = -1 // Close walks the table, as for an adopted one
	}
	h.register(sb)
	return sb, nil
}

// Adopt takes over the network of a running sandbox another process made:
// its rules are rewritten for this process's resolver and log group, and
// its learned addresses forgotten (this process does not know their names:
// the sandbox resolves them again).
func (h *Host) Adopt(id string, slot int, p Policy) (*Sandbox, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	sb := newSandbox(h, id, slot, p)
	if _, err := sb.start(); err != nil {
		return nil, err
	}
	sb.link = linkIndex(slot)
	h.register(sb)
	return sb, nil
}

func (h *Host) register(sb *Sandbox) {
	h.mu.Lock()
	h.bySlot[sb.Slot] = sb
	h.byIP[sb.IP] = sb
	h.mu.Unlock()
}

func (h *Host) rules(sb *Sandbox, p Policy) *sandboxRules {
	return &sandboxRules{slot: sb.Slot, ip: sb.IP, gateway: h.gateway, policy: p, denied: h.denied,
		resolver: h.res.port, group: h.flog.group}
}

func (h *Host) bySource(a netip.Addr) *Sandbox {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.byIP[a]
}

// sender is the sandbox that sent a packet from address a that came in on
// the host's interface of index link: the sandbox that holds the address
// now, only if that interface is its own. A slot's address passes to the
// next sandbox that takes the slot, but its interface is made anew, and
// the kernel does not hand out an index again: a packet its last holder
// sent, still queued (in the kernel log's socket, the resolver's) when the
// slot changed hands, is nobody's, never the new holder's.
func (h *Host) sender(a netip.Addr, link int) *Sandbox {
	sb := h.bySource(a)
	if sb == nil || link == 0 || sb.link != link {
		return nil
	}
	return sb
}

// GC removes the rules and interfaces of slots that no live sandbox holds
// (held reports whether one does).
func (h *Host) GC(held func(slot int) bool) []int {
	var removed []int
	slots, _ := h.nft.slots()
	seen := map[int]bool{}
	for _, s := range append(slots, hostLinks()...) {
		if seen[s] {
			continue
		}
		seen[s] = true // (a slot with rules and a link is asked about once)
		if held(s) {
			continue
		}
		h.mu.Lock()
		_, ours := h.bySlot[s]
		h.mu.Unlock()
		if ours {
			continue
		}
		_ = removeLink(s)
		_ = h.nft.remove(s)
		_ = forgetFlows(h.IP(s))
		removed = append(removed, s)
	}
	if n := h.nft.sweep(); n > 0 {
		h.log.Info("network: swept elements no sandbox holds", "elements", n)
	}
	return removed
}

// HostLinks lists the slots that have an interface on the host.
func HostLinks() []int { return hostLinks() }

// RuleSlots lists the slots that have rules in the shared table.
func (h *Host) RuleSlots() ([]int, error) { return h.nft.slots() }

// TableSlots lists the slots that have rules in the shared table, for a
// process that has no Host (a check for leftovers).
func TableSlots() ([]int, error) {
	n, err := newNFT()
	if err != nil {
		return nil, err
	}
	defer n.close()
	return n.slots()
}

// logged turns a kernel log record into a Record: the sandbox is the
// packet's source on the interface it came in on (the rules logged it only
// from its own interface; see sender for a slot that changed hands).
func (h *Host) logged(decision string, inLink int, pkt []byte) {
	proto, dst, ok := packetDest(pkt)
	if !ok {
		return
	}
	sb := h.sender(netip.AddrFrom4([4]byte(pkt[12:16])), inLink)
	if sb == nil {
		return
	}
	d := "allow"
	if decision == logDeny {
		d = "deny"
	}
	h.record(Record{Sandbox: sb.ID, Kind: "connect", Decision: d, Proto: proto, Dest: dst.String()})
}

func (h *Host) record(r Record) {
	if r.Time.IsZero() {
		r.Time = time.Now()
	}
	h.log.Debug("network", "sandbox", r.Sandbox, "kind", r.Kind, "decision", r.Decision, "dest", r.Dest, "name", r.Name)
	if h.cfg.Record != nil {
		h.cfg.Record(r)
	}
}
