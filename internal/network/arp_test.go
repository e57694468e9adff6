package network

import (
	"encoding/binary"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// arpRequest is an Ethernet frame asking who has target, from sender
// (hardware address mac).
func arpRequest(mac net.HardwareAddr, sender, target netip.Addr) []byte {
	f := make([]byte, 42)
	copy(f[0:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	copy(f[6:12], mac)
	binary.BigEndian.PutUint16(f[12:], unix.ETH_P_ARP)
	binary.BigEndian.PutUint16(f[14:], 1)             // Ethernet
	binary.BigEndian.PutUint16(f[16:], unix.ETH_P_IP) // IPv4
	f[18], f[19] = 6, 4                               // address lengths
	binary.BigEndian.PutUint16(f[20:], 1)             // request
	copy(f[22:28], mac)
	copy(f[28:32], sender.AsSlice())
	copy(f[38:42], target.AsSlice())
	return f
}

// sendARP sends frames on eth0 inside ns through a packet socket (root in
// a microVM's guest can; a sandbox's commands hold no CAP_NET_RAW) and
// counts the ARP replies it sees within a short while.
func sendARP(ns netns.NsHandle, frames func(mac net.HardwareAddr) [][]byte) (replies int, err error) {
	err = testutil.InNS(ns, func() error {
		eth, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		proto := uint16(unix.ETH_P_ARP&0xff)<<8 | uint16(unix.ETH_P_ARP>>8)
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		to := &unix.SockaddrLinklayer{Protocol: proto, Ifindex: eth.Index}
		if err := unix.Bind(fd, to); err != nil {
			return err
		}
		for _, f := range frames(eth.HardwareAddr) {
			if err := unix.Sendto(fd, f, 0, to); err != nil {
				return err
			}
		}
		_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 100000})
		b := make([]byte, 128)
		deadline := time.Now().Add(500 * time.Millisecond)
		for time.Now().Before(deadline) {
			n, _, err := unix.Recvfrom(fd, b, 0)
			if err == nil && n >= 42 && binary.BigEndian.Uint16(b[20:]) == 2 {
				replies++
			}
		}
		return nil
	})
	return replies, err
}

// Attack: a sandbox that can send raw frames (root in a microVM's guest,
// a compromised guest kernel) asks the gateway's address from a thousand
// sender addresses not its own. The kernel's ARP table is one for every
// network namespace of the host (gc_thresh3 bounds all of them together),
// and the host adds an entry for the sender of each request it answers.
// Expected: the host's end of the sandbox's link learns no neighbour but
// the sandbox's own address.
func TestARPSpoofedSendersLearnNothing(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Internet})
	gw := h.Gateway()
	const n = 1000
	replies, err := sendARP(a.ns, func(mac net.HardwareAddr) [][]byte {
		var fs [][]byte
		for i := range n {
			sender := netip.AddrFrom4([4]byte{198, 51, byte(i >> 8), byte(i)})
			fs = append(fs, arpRequest(mac, sender, gw))
		}
		return fs
	})
	if err != nil {
		t.Fatal(err)
	}
	link, err := netlink.LinkByName(ifName(a.net.Slot))
	if err != nil {
		t.Fatal(err)
	}
	neigh, err := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	learned := 0
	for _, e := range neigh {
		if a4, ok := netip.AddrFromSlice(e.IP.To4()); ok && a4 != a.net.IP {
			learned++
		}
	}
	t.Logf("%d requests from forged senders: %d replies, %d neighbours learned", n, replies, learned)
	if learned > 0 {
		t.Errorf("the host learned %d neighbours on %s from forged ARP senders", learned, ifName(a.net.Slot))
	}
	// Control: the sandbox's own address still gets the gateway's answer.
	replies, err = sendARP(a.ns, func(mac net.HardwareAddr) [][]byte {
		return [][]byte{arpRequest(mac, a.net.IP, gw)}
	})
	if err != nil || replies == 0 {
		t.Errorf("control: the gateway did not answer the sandbox's own request (%d replies, %v)", replies, err)
	}
	// The host's other addresses (its uplink's, its metadata address) are
	// not told to the sandbox.
	for _, other := range []netip.Addr{w.HostHTTP.Addr(), testutil.MetadataAddrs[0]} {
		replies, err = sendARP(a.ns, func(mac net.HardwareAddr) [][]byte {
			return [][]byte{arpRequest(mac, a.net.IP, other)}
		})
		if err != nil || replies > 0 {
			t.Errorf("the host answered the sandbox who has %v, its own address (%d replies, %v)", other, replies, err)
		}
	}
}
