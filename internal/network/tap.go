package network

import (
	"fmt"
	"os"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A microVM's network: its NIC is backed by a tap device in the sandbox's
// network namespace, and the namespace's eth0 (the veth Attach made) and
// the tap are spliced together with tc redirects, both ways, before either
// stack sees a frame. The namespace itself routes nothing: the guest holds
// the sandbox's address, and the host end of the veth, where every rule is
// enforced, sees the guest's frames as it sees a container's.

// TapName is the tap device's name inside the namespace.
const TapName = "tap0"

// GuestMAC is the address of every microVM's NIC: each sits alone on its
// own veth, so they need not differ, and a fixed one keeps a snapshot's
// device state valid for every restore.
const GuestMAC = "52:54:00:ca:9e:01"

// AttachTap makes the tap device in the namespace nsFD, splices it with
// the namespace's eth0, and returns the tap's descriptor for the VMM
// (multi-queue off, with virtio-net headers).
func AttachTap(nsFD int) (*os.File, error) {
	tap, err := openTapIn(nsFD)
	if err != nil {
		return nil, err
	}
	h, err := netlink.NewHandleAt(netns.NsHandle(nsFD), unix.NETLINK_ROUTE)
	if err != nil {
		tap.Close()
		return nil, fmt.Errorf("netlink in the sandbox's namespace: %w", err)
	}
	defer h.Close()
	if err := splice(h, "eth0", TapName); err != nil {
		tap.Close()
		return nil, err
	}
	return tap, nil
}

// OpenTap makes a tap device in the namespace nsFD and returns its
// descriptor, spliced to nothing: the NIC of a VM that must have one to be
// like another (a snapshot's) but reaches nowhere.
func OpenTap(nsFD int) (*os.File, error) { return openTapIn(nsFD) }

// openTapIn opens /dev/net/tun from a thread in the namespace nsFD (a tun
// device belongs to the namespace of whoever opened the clone device) and
// makes the tap.
func openTapIn(nsFD int) (*os.File, error) {
	var tun *os.File
	err := onThreadIn(nsFD, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		tun = os.NewFile(uintptr(fd), "/dev/net/tun")
		return nil
	})
	if err != nil {
		return nil, err
	}
	ifr, err := unix.NewIfreq(TapName)
	if err != nil {
		tun.Close()
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, tun.Fd(), unix.TUNSETIFF, uintptr(unsafe.Pointer(ifr))); errno != 0 {
		tun.Close()
		return nil, fmt.Errorf("make the tap device: %w", errno)
	}
	return tun, nil
}

// splice redirects every frame arriving on a to b's output and back.
func splice(h *netlink.Handle, a, b string) error {
	la, err := h.LinkByName(a)
	if err != nil {
		return err
	}
	lb, err := h.LinkByName(b)
	if err != nil {
		return err
	}
	// A queue for each, before their ingress qdiscs (a veth peer has
	// none, which the kernel complains of).
	for _, l := range []netlink.Link{la, lb} {
		if err := h.LinkSetTxQLen(l, 1000); err != nil {
			return fmt.Errorf("queue of %s: %w", l.Attrs().Name, err)
		}
	}
	if err := h.LinkSetUp(lb); err != nil {
		return fmt.Errorf("bring %s up: %w", b, err)
	}
	for _, p := range [][2]netlink.Link{{la, lb}, {lb, la}} {
		from, to := p[0], p[1]
		q := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: from.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
		if err := h.QdiscAdd(q); err != nil {
			return fmt.Errorf("ingress qdisc on %s: %w", from.Attrs().Name, err)
		}
		f := &netlink.U32{
			FilterAttrs: netlink.FilterAttrs{LinkIndex: from.Attrs().Index, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL},
			Actions: []netlink.Action{&netlink.MirredAction{ActionAttrs: netlink.ActionAttrs{Action: netlink.TC_ACT_STOLEN},
				MirredAction: netlink.TCA_EGRESS_REDIR, Ifindex: to.Attrs().Index}},
		}
		if err := h.FilterAdd(f); err != nil {
			return fmt.Errorf("redirect %s to %s: %w", from.Attrs().Name, to.Attrs().Name, err)
		}
	}
	return nil
}
