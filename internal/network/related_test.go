package network

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// inetChecksum is the Internet checksum (RFC 1071) of b.
func inetChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// icmpError is an ICMP destination unreachable (port unreachable) message
// about a UDP datagram from src:sport to dst:dport, followed by data.
func icmpError(src netip.Addr, sport uint16, dst netip.Addr, dport uint16, data []byte) []byte {
	inner := make([]byte, 28, 28+len(data))
	inner[0], inner[8], inner[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(inner[2:], uint16(28+len(data)))
	copy(inner[12:], src.AsSlice())
	copy(inner[16:], dst.AsSlice())
	binary.BigEndian.PutUint16(inner[10:], inetChecksum(inner[:20]))
	binary.BigEndian.PutUint16(inner[20:], sport)
	binary.BigEndian.PutUint16(inner[22:], dport)
	binary.BigEndian.PutUint16(inner[24:], uint16(8+len(data)))
	inner = append(inner, data...)
	msg := append([]byte{3, 3, 0, 0, 0, 0, 0, 0}, inner...)
	binary.BigEndian.PutUint16(msg[2:], inetChecksum(msg))
	return msg
}

// sendRawICMP sends msg (an ICMP message) to dst from inside ns through a
// raw socket: what a sandbox's code cannot do, but root in a microVM's
// guest, or a compromised guest kernel, can.
func sendRawICMP(ns netns.NsHandle, dst netip.Addr, msg []byte, times int) error {
	return testutil.InNS(ns, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		to := &unix.SockaddrInet4{Addr: dst.As4()}
		for range times {
			if err := unix.Sendto(fd, msg, 0, to); err != nil {
				return err
			}
			time.Sleep(20 * time.Millisecond)
		}
		return nil
	})
}

// Attack: sandbox A has an empty allowlist; sandbox B (internet: another
// tenant's, or the attacker's own) keeps a UDP flow with a server outside.
// A (root in its kernel: raw sockets) sends the server ICMP errors that
// name B's flow as the packet they are about, carrying data of A's
// choosing after it. The host's rules accept what belongs to, or is
// related to, a tracked connection before asking whose it is. Expected:
// nothing A sends about B's flow leaves the host (A reaches nothing), and
// A's data never reaches the server.
func TestRelatedPacketsRideNoOtherFlow(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Allowlist})
	b := attach(t, h, Policy{Mode: Internet})
	const port, sport = 7300, 41000
	udpEcho(t, w, port)
	var err error
	for range 5 {
		if _, err = b.exchange(sport, port, "b"); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("B's flow: %v", err)
	}
	// The server's side: every ICMP message it receives.
	var rfd int
	if err := testutil.InNS(w.Public, func() (err error) {
		rfd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP)
		return
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	_ = unix.SetsockoptTimeval(rfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000})
	secret := []byte("SECRET-FROM-A-" + a.net.ID)
	msg := icmpError(testutil.PublicHost, port, b.net.IP, sport, secret)
	if err := sendRawICMP(a.ns, testutil.PublicHost, msg, 3); err != nil {
		t.Fatal(err)
	}
	// Control: the same from B, about its own flow, gets out.
	own := []byte("OWN-FROM-B-" + b.net.ID)
	if err := sendRawICMP(b.ns, testutil.PublicHost, icmpError(testutil.PublicHost, port, b.net.IP, sport, own), 3); err != nil {
		t.Fatal(err)
	}
	var leaked, control bool
	buf := make([]byte, 2048)
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) && !(leaked && control) {
		n, _, err := unix.Recvfrom(rfd, buf, 0)
		if err != nil {
			continue
		}
		leaked = leaked || bytes.Contains(buf[:n], secret)
		control = control || bytes.Contains(buf[:n], own)
	}
	if leaked {
		t.Errorf("A (nothing allowed) got data to %v riding B's flow as related ICMP", testutil.PublicHost)
	}
	if !control {
		t.Errorf("control: B's ICMP error about its own flow did not get out")
	}
}

// Attack: the host keeps a UDP exchange with a server outside (its
// resolver asking upstream); a sandbox (root in its kernel) sends the
// host ICMP port-unreachable errors naming that exchange. Expected: the
// host's rules drop them (they are about no connection of the sandbox's),
// so the host's socket never fails with ECONNREFUSED.
func TestRelatedPacketsToHostOnlyOwn(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, Policy{Mode: Internet})
	const port = 7301
	udpEcho(t, w, port)
	c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: testutil.PublicHost.AsSlice(), Port: port})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := make([]byte, 512)
	for i := 0; ; i++ {
		_, _ = c.Write([]byte("host"))
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		if _, err := c.Read(b); err == nil {
			break
		}
		if i == 10 {
			t.Fatal("the host's exchange with the server got no answer")
		}
	}
	local := c.LocalAddr().(*net.UDPAddr)
	self, _ := netip.AddrFromSlice(local.IP.To4())
	msg := icmpError(self, uint16(local.Port), testutil.PublicHost, port, []byte("x"))
	if err := sendRawICMP(a.ns, self, msg, 3); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Read(b); errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("a sandbox's forged ICMP error failed the host's exchange: %v", err)
	}
}
