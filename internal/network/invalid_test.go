package network

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// tcpSegment is a TCP header (no options, no data) from sport to dport
// with flags, its checksum over src and dst.
func tcpSegment(src, dst netip.Addr, sport, dport uint16, flags byte) []byte {
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:], sport)
	binary.BigEndian.PutUint16(seg[2:], dport)
	binary.BigEndian.PutUint32(seg[4:], 0x12345678)
	seg[12], seg[13] = 5<<4, flags
	binary.BigEndian.PutUint16(seg[14:], 1024)
	pseudo := append(append(append([]byte{}, src.AsSlice()...), dst.AsSlice()...), 0, unix.IPPROTO_TCP, 0, 20)
	binary.BigEndian.PutUint16(seg[16:], inetChecksum(append(pseudo, seg...)))
	return seg
}

// sendRawTCP sends a TCP segment to dst from inside ns through a raw socket
// (root in a microVM's guest can; a sandbox's commands cannot).
func sendRawTCP(ns netns.NsHandle, src, dst netip.Addr, seg []byte) error {
	return testutil.InNS(ns, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		for range 3 {
			if err := unix.Sendto(fd, seg, 0, &unix.SockaddrInet4{Addr: dst.As4()}); err != nil {
				return err
			}
			time.Sleep(20 * time.Millisecond)
		}
		return nil
	})
}

// Attack: a sandbox with internet that can send raw packets (root in a
// microVM's guest) sends TCP segments conntrack finds invalid (SYN and
// FIN together): no connection is tracked for them, so masquerading does
// not apply. Expected: none leaves the host, least of all with the
// sandbox's own address as its source.
func TestInvalidPacketsStayIn(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Internet})
	var rfd int
	if err := testutil.InNS(w.Public, func() (err error) {
		rfd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		return
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	_ = unix.SetsockoptTimeval(rfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000})
	const sport, dport = 47001, 7500
	seg := tcpSegment(a.net.IP, testutil.PublicHost, sport, dport, tcpSYN|tcpFIN)
	if err := sendRawTCP(a.ns, a.net.IP, testutil.PublicHost, seg); err != nil {
		t.Fatal(err)
	}
	// Control: a plain SYN from the same port gets out (masqueraded).
	if err := sendRawTCP(a.ns, a.net.IP, testutil.PublicHost, tcpSegment(a.net.IP, testutil.PublicHost, sport+1, dport, tcpSYN)); err != nil {
		t.Fatal(err)
	}
	var invalid, control int
	var from []netip.Addr
	buf := make([]byte, 2048)
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		n, _, err := unix.Recvfrom(rfd, buf, 0)
		if err != nil || n < 40 {
			continue
		}
		ihl := int(buf[0]&0xf) * 4
		if binary.BigEndian.Uint16(buf[ihl+2:]) != dport {
			continue
		}
		src, _ := netip.AddrFromSlice(buf[12:16])
		switch buf[ihl+13] & (tcpSYN | tcpFIN) {
		case tcpSYN | tcpFIN:
			invalid++
			from = append(from, src)
		case tcpSYN:
			control++
		}
	}
	if invalid > 0 {
		t.Errorf("%d invalid segments of the sandbox's got out, from %v", invalid, from)
	}
	if control == 0 {
		t.Error("control: the sandbox's plain SYN did not get out")
	}
}

// Attack: the host's admin exempts some traffic from connection tracking
// (a raw-table notrack rule, as some do for DNS or bulk ports); a sandbox
// with internet sends to such a port. Expected: its untracked packets,
// which nothing can masquerade, do not leave with its own address.
func TestUntrackedPacketsStayIn(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Internet})
	const port = 7501
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	raw := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "admin_raw"})
	ch := c.AddChain(&nftables.Chain{Name: "pre", Table: raw, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRaw})
	c.AddRule(&nftables.Rule{Table: raw, Chain: ch, Exprs: cat(l4proto(unix.IPPROTO_UDP), dport(port), []expr.Any{&expr.Notrack{}})})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.DelTable(raw); _ = c.Flush() })
	pc := listenOutside(t, w, port)
	a.send(t, a.net.IP, port, "untracked")
	_ = pc.SetReadDeadline(time.Now().Add(time.Second))
	if n, from, err := pc.ReadFrom(make([]byte, 64)); err == nil {
		t.Errorf("an untracked datagram of the sandbox's got out (%d bytes from %v)", n, from)
	}
}
