package network

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/procsys"
)

// Each sandbox with a network has a veth pair: cage<slot> on the host and
// eth0 in the sandbox's network namespace. The sandbox's address is a /32;
// the gateway address, the same for every sandbox, sits on every host end,
// so that one resolv.conf serves all:
//
//	sandbox: eth0 <ip>/32; route <gateway> dev eth0; default via <gateway>
//	host:    cage<slot> <gateway>/32; route <ip>/32 dev cage<slot>
//
// The host end has IPv6 disabled and nftables drops any IPv6 from a sandbox:
// sandboxes are IPv4 only.

// linkMu serialises this process's attachLinks. Each of their steps takes
// the kernel's rtnl lock anyway, so running them one at a time loses
// nothing; but the IPv6 sysctl write does not wait for that lock: it
// tries it and restarts the write while another holds it, spinning on a
// CPU. With creates at once (8 on a 2-core host) that spin took a fifth
// of the daemon's CPU, starving the very holders it waited for.
var linkMu sync.Mutex

// rtnl is this process's netlink socket for the links on the host: one for
// every request (the package's functions open and close a socket for each).
// It lives in the namespace of the thread that first asks, which is the
// host's: no caller of attachLink or removeLink has moved its thread. Its
// requests time out as the package's own sockets' do (a minute).
var rtnl = sync.OnceValue(func() *netlink.Handle {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err == nil {
		err = h.SetSocketTimeout(time.Minute)
	}
	if err != nil {
		if h != nil {
			h.Close()
		}
		return &netlink.Handle{} // a socket per request, as before
	}
	return h
})

// confDirs are the host's /proc/sys/net/ipv4/conf and ipv6/conf, opened
// once, from the host's network namespace as every attachLink runs: a host
// end's knobs are opened relative to them. A path from /proc/sys walks,
// at "net", a chain of one entry per network namespace that has looked
// there (sysctl's directories are per namespace, all of one name under
// /proc/sys): as long as the sandboxes alive, and taken at every create.
var confDirs = sync.OnceValue(func() (dirs [2]*os.File) {
	for i, v := range []string{"ipv4", "ipv6"} {
		if f, err := os.Open("/proc/sys/net/" + v + "/conf"); err == nil {
			dirs[i] = f
		}
	}
	return dirs
})

// writeConf writes value to the knob rel (IFNAME/KNOB) of the host's IPv4
// (version 4) or IPv6 (6) interface settings. Where the directory could
// not be opened, the path is walked from /proc/sys.
func writeConf(version int, rel, value string) error {
	dir, path := confDirs()[0], "/proc/sys/net/ipv4/conf/"+rel
	if version == 6 {
		dir, path = confDirs()[1], "/proc/sys/net/ipv6/conf/"+rel
	}
	if dir == nil {
		return os.WriteFile(path, []byte(value), 0)
	}
	fd, err := unix.Openat(int(dir.Fd()), rel, unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(value)); err != nil {
		return &os.PathError{Op: "write", Path: path, Err: err}
	}
	return nil
}

// attachLink makes the pair with its peer inside the namespace nsFD, and
// says the index of the host's end.
func attachLink(slot, nsFD int, ip, gw netip.Addr) (index int, err error) {
	linkMu.Lock()
	defer linkMu.Unlock()
	nl := rtnl()
	name := ifName(slot)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name, TxQLen: 1000}, PeerName: "eth0", PeerNamespace: netlink.NsFd(nsFD)}
	err = nl.LinkAdd(veth)
	if errors.Is(err, unix.EEXIST) {
		// A leftover of a sandbox whose owner died holds the name.
		if old, lerr := nl.LinkByName(name); lerr == nil {
			_ = nl.LinkDel(old)
		}
		veth.Index = 0
		err = nl.LinkAdd(veth)
	}
	if err != nil {
		return 0, fmt.Errorf("create veth %s: %w", name, err)
	}
	defer func() {
		if err != nil {
			_ = nl.LinkDel(veth)
		}
	}()
	// Before the link is up, so that it never gets an IPv6 link-local address.
	if err := writeConf(6, name+"/disable_ipv6", "1"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("disable IPv6 on %s: %w", name, err)
	}
	// ARP on the host end: answer only for the gateway (the address on this
	// link; arp_ignore 1), and only a sender the host routes to over this
	// link (arp_filter 1: the sandbox's own address). The host adds a
	// neighbour entry for the sender of each request it answers, and the
	// ARP table is one for every namespace of the host: a sandbox sending
	// requests from forged senders (root in a microVM's guest) had the
	// host learn each, and could fill the table (gc_thresh3) for the host
	// and every sandbox; and its requests for the host's other addresses
	// were answered, naming them (found by review, 2026-12-03).
	for knob, v := range map[string]string{"arp_ignore": "1", "arp_filter": "1"} {
		if err := writeConf(4, name+"/"+knob, v); err != nil {
			return 0, fmt.Errorf("%s on %s: %w", knob, name, err)
		}
	}
	// LinkAdd learnt the host end's index.
	if veth.Index == 0 {
		return 0, fmt.Errorf("create veth %s: its index is unknown", name)
	}
	if err := nl.AddrAdd(veth, &netlink.Addr{IPNet: ipnet(gw), Flags: unix.IFA_F_NOPREFIXROUTE}); err != nil {
		return 0, fmt.Errorf("address %s on %s: %w", gw, name, err)
	}
	if err := nl.LinkSetUp(veth); err != nil {
		return 0, fmt.Errorf("bring %s up: %w", name, err)
	}
	if err := nl.RouteAdd(&netlink.Route{LinkIndex: veth.Index, Dst: ipnet(ip), Scope: netlink.SCOPE_LINK}); err != nil {
		return 0, fmt.Errorf("route to %s: %w", ip, err)
	}
	if err := configureInside(nsFD, ip, gw); err != nil {
		return 0, err
	}
	return veth.Index, syncCarrier(nl, veth.Index)
}

// configureInside gives the sandbox's eth0 its address and routes.
func configureInside(nsFD int, ip, gw netip.Addr) error {
	h, err := netlink.NewHandleAt(netns.NsHandle(nsFD), unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink in the sandbox's namespace: %w", err)
	}
	defer h.Close()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("the sandbox's eth0: %w", err)
	}
	// No IPv6 on eth0 either (the host's end has none): sandboxes get no
	// IPv6 route, and a link-local address let one fill the host's IPv6
	// neighbour table, one for every namespace (gc_thresh3, 1,024), with
	// sends to fe80::N%eth0 (found by review, 2026-12-03).
	if err := onThreadIn(nsFD, func() error {
		err := procsys.Write("net/ipv6/conf/eth0/disable_ipv6", "1")
		if errors.Is(err, os.ErrNotExist) {
			return nil // a kernel without IPv6
		}
		return err
	}); err != nil {
		return fmt.Errorf("IPv6 off on the sandbox's eth0: %w", err)
	}
	if err := h.AddrAdd(eth0, &netlink.Addr{IPNet: ipnet(ip)}); err != nil {
		return fmt.Errorf("address %s in the sandbox: %w", ip, err)
	}
	if err := h.LinkSetUp(eth0); err != nil {
		return err
	}
	if lo, err := h.LinkByName("lo"); err == nil {
		_ = h.LinkSetUp(lo)
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: ipnet(gw), Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("route to the gateway in the sandbox: %w", err)
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
		return fmt.Errorf("default route in the sandbox: %w", err)
	}
	return syncCarrier(h, eth0.Attrs().Index)
}

// syncCarrier makes the kernel act on a link's carrier now. Both ends of a
// pair get their carrier as the second comes up, but each starts sending
// only once the kernel's link watcher has given it its queue, later, from
// a worker (up to a second on a busy host): until then what it sends is
// dropped. A sandbox's first packet (an ARP request) went out and the
// host's answer was dropped; the sandbox asked again a second later, so
// its first DNS question or connection waited that second (9 of 100
// fresh sandboxes here, under a test suite's load). Asking for the link
// runs the watcher's work for it at once (rtnl_getlink syncs the carrier).
func syncCarrier(h *netlink.Handle, index int) error {
	if _, err := h.LinkByIndex(index); err != nil {
		return fmt.Errorf("the link %d: %w", index, err)
	}
	return nil
}

// linkIndex is the index of cage<slot> on the host (0: there is none).
func linkIndex(slot int) int {
	l, err := rtnl().LinkByName(ifName(slot))
	if err != nil {
		return 0
	}
	return l.Attrs().Index
}

// removeLink deletes cage<slot> (its peer goes with it).
func removeLink(slot int) error {
	nl := rtnl()
	l, err := nl.LinkByName(ifName(slot))
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return err
	}
	if err := nl.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
		return err // (ENODEV: the namespace went and took the pair with it)
	}
	return nil
}

// linkExists says whether the host has a link of that index.
func linkExists(index int) bool {
	_, err := rtnl().LinkByIndex(index)
	var nf netlink.LinkNotFoundError
	return !errors.As(err, &nf)
}

// carriedNothing says whether slot's interface pair never carried a
// packet between the sandbox and the host, either way: then nothing of
// the sandbox's address was ever tracked in the host's connection table,
// and its end need not walk the table to forget it (forgetFlows: some 3
// ms of the kernel's time a walk here, whatever few entries it holds).
// Any packet the host tracked crossed the pair: the sandbox's own enter by
// the host end (its received count, taken as the packet crosses, before
// the host's rules see it), the host's and the outside's leave by it
// (sent, or dropped on the way, counted after the kernel confirmed their
// connection); a packet the host's rules refused (another sandbox's, a
// forged source) was never confirmed, so never tracked. The caller has
// removed the slot's rules first: from then on the host refuses what the
// sandbox sends and any new connection to it, so what crosses after the
// counters are read is tracked by nobody.
//
// The counters are read while the pair still has both ends (a veth's
// count of what it received is its peer's count of what it sent; once the
// sandbox's namespace has gone, its end with it, that part reads as 0): a
// second look that still finds the peer says the first did, as a peer once
// gone never comes back. Any doubt (the link gone or not a veth, an error,
// no counters, the peer gone) says false.
func carriedNothing(slot int) bool {
	nl := rtnl()
	name := ifName(slot)
	l, err := nl.LinkByName(name)
	if err != nil {
		return false
	}
	if _, ok := l.(*netlink.Veth); !ok {
		return false
	}
	first, err := nl.LinkByName(name)
	if err != nil {
		return false
	}
	again, err := nl.LinkByName(name)
	if err != nil {
		return false
	}
	a, b := first.Attrs(), again.Attrs()
	st := a.Statistics
	if st == nil || a.Index != l.Attrs().Index || b.Index != a.Index || a.ParentIndex == 0 || b.ParentIndex != a.ParentIndex {
		return false
	}
	return st.RxPackets == 0 && st.TxPackets == 0 && st.RxDropped == 0 && st.TxDropped == 0 &&
		st.RxErrors == 0 && st.TxErrors == 0
}

// hostLinks lists the slots of the cage<slot> links on the host.
func hostLinks() []int {
	names, err := linkNames()
	if err != nil {
		return nil
	}
	var out []int
	for _, name := range names {
		if slot, ok := slotOf(name); ok {
			out = append(out, slot)
		}
	}
	return out
}

// linkNames lists the names of the links in the calling thread's network
// namespace. Every `cage run` asks (its GC, beside its command): a dump
// of whole links (netlink.LinkList) had the kernel fill, and the process
// decode, each link's attributes and statistics, a third of the run's GC
// with a daemon's 200 sandboxes alive on the host (measured 2026-12-05:
// 400 links listed in 2.9-6.4 ms, 1.3-2.8 ms by this, which asks the
// kernel to leave the statistics out and reads only the names). sysfs's
// net class would be cheaper still, but it shows the namespace sysfs was
// mounted from, which a process in a namespace of its own (the tests',
// `unshare -n`) does not share.
func linkNames() ([]string, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	const skipStats = 1 << 3 // RTEXT_FILTER_SKIP_STATS (a kernel without it sends them)
	req := make([]byte, unix.NLMSG_HDRLEN+unix.SizeofIfInfomsg+8)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.RTM_GETLINK)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], 1) // sequence
	at := unix.NLMSG_HDRLEN + unix.SizeofIfInfomsg
	binary.NativeEndian.PutUint16(req[at:], 8)
	binary.NativeEndian.PutUint16(req[at+2:], unix.IFLA_EXT_MASK)
	binary.NativeEndian.PutUint32(req[at+4:], skipStats)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, err
	}
	var names []string
	buf := make([]byte, 64<<10)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, err
		}
		if n < unix.NLMSG_HDRLEN {
			return nil, errors.New("link dump: short netlink message")
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, err
		}
		for i := range msgs {
			switch msgs[i].Header.Type {
			case unix.NLMSG_DONE:
				return names, nil
			case unix.NLMSG_ERROR:
				return nil, errors.New("link dump: netlink error")
			case unix.RTM_NEWLINK:
				attrs, err := syscall.ParseNetlinkRouteAttr(&msgs[i])
				if err != nil {
					continue
				}
				for _, a := range attrs {
					if a.Attr.Type == unix.IFLA_IFNAME {
						names = append(names, string(bytes.TrimRight(a.Value, "\x00")))
					}
				}
			}
		}
	}
}

// slotOf is the slot of a host-side interface name, cage<slot>.
func slotOf(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, ifPrefix)
	if !ok {
		return 0, false
	}
	slot, err := strconv.Atoi(rest)
	return slot, err == nil && slot >= 0 && ifName(slot) == name
}

func ipnet(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}
}

// NewNamespace makes a network namespace (owned by the host's user
// namespace, so that nothing inside can reconfigure it) and bind-mounts it
// at path, for a runtime that joins a namespace by path and has no user
// namespace (gVisor, which needs its interfaces to exist when it starts).
func NewNamespace(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return err
	}
	f.Close()
	err = onThreadIn(-1, func() error {
		return unix.Mount(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), path, "", unix.MS_BIND, "")
	})
	if err != nil {
		_ = os.Remove(path)
		return err
	}
	return nil
}

// PinNamespace bind-mounts the network namespace nsFD at path, as
// NewNamespace does a new one: for a runtime that joins it by path (runc,
// whose container's user namespace owns it: see oci.ownedNamespaces).
func PinNamespace(nsFD int, path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return err
	}
	f.Close()
	if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", nsFD), path, "", unix.MS_BIND, ""); err != nil {
		_ = os.Remove(path)
		return err
	}
	return nil
}

// onThreadIn runs fn on a thread of its own moved into the network
// namespace nsFD (-1: a new one), then moves the thread back and lets it go
// on. A thread is never thrown away: a process started with a parent-death
// signal (QEMU, a `cage run` sandbox's agent) dies with the thread that
// forked it, and Go may have forked it from any of them. A thread that
// cannot go back is the exception, and is ended.
func onThreadIn(nsFD int, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer unix.Close(orig)
		if nsFD < 0 {
			err = unix.Unshare(unix.CLONE_NEWNET)
		} else {
			err = unix.Setns(nsFD, unix.CLONE_NEWNET)
		}
		if err != nil {
			if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
				runtime.UnlockOSThread()
			}
			errc <- fmt.Errorf("network namespace: %w", err)
			return
		}
		err = fn()
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// RemoveNamespace unmounts and removes what NewNamespace made.
func RemoveNamespace(path string) {
	_ = unix.Unmount(path, unix.MNT_DETACH)
	_ = os.Remove(path)
}

// ConfigureInside gives the sandbox's eth0, in the namespace nsFD, its
// address and routes again (as Attach did): gVisor takes them off the
// interface as it starts, and reads them from there when it restores a
// checkpoint of the sandbox.
func (sb *Sandbox) ConfigureInside(nsFD int) error {
	h, err := netlink.NewHandleAt(netns.NsHandle(nsFD), unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink in the sandbox's namespace: %w", err)
	}
	defer h.Close()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("the sandbox's eth0: %w", err)
	}
	gw := sb.h.gateway
	if err := h.AddrReplace(eth0, &netlink.Addr{IPNet: ipnet(sb.IP)}); err != nil {
		return fmt.Errorf("address %s in the sandbox: %w", sb.IP, err)
	}
	if err := h.LinkSetUp(eth0); err != nil {
		return err
	}
	if err := h.RouteReplace(&netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: ipnet(gw), Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("route to the gateway in the sandbox: %w", err)
	}
	if err := h.RouteReplace(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
		return fmt.Errorf("default route in the sandbox: %w", err)
	}
	return nil
}
