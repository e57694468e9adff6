package network

import (
	"bufio"
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// fragMemory is what the kernel holds of incomplete IPv4 fragment queues
// in this (the host's) network namespace, in bytes (/proc/net/sockstat's
// FRAG line).
func fragMemory(t *testing.T) int {
	t.Helper()
	f, err := os.Open("/proc/net/sockstat")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 5 && fields[0] == "FRAG:" && fields[3] == "memory" {
			n, err := strconv.Atoi(fields[4])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no FRAG line in /proc/net/sockstat")
	return 0
}

// sendFirstFragments sends n first fragments (more-fragments set, offset
// 0) of UDP datagrams from src to dst, each of its own datagram (its own
// id) whose rest never comes, from inside ns through a raw socket (root in
// a microVM's guest can; a sandbox's commands cannot).
func sendFirstFragments(s *fakeSandbox, dst netip.Addr, n int) error {
	return testutil.InNS(s.ns, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		pkt := make([]byte, 1400)
		pkt[0], pkt[8], pkt[9] = 0x45, 64, unix.IPPROTO_UDP
		binary.BigEndian.PutUint16(pkt[2:], uint16(len(pkt)))
		binary.BigEndian.PutUint16(pkt[6:], 0x2000) // more fragments, offset 0
		src, d := s.net.IP.As4(), dst.As4()
		copy(pkt[12:], src[:])
		copy(pkt[16:], d[:])
		binary.BigEndian.PutUint16(pkt[20:], 40000) // UDP header: ports, a length past this fragment
		binary.BigEndian.PutUint16(pkt[22:], 7600)
		binary.BigEndian.PutUint16(pkt[24:], 4000)
		for i := range n {
			binary.BigEndian.PutUint16(pkt[4:], uint16(i+1))
			if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: d}); err != nil {
				return err
			}
			if i%200 == 199 {
				time.Sleep(2 * time.Millisecond) // let the host's side take them
			}
		}
		return nil
	})
}

// Attack: a sandbox that can send raw packets (root in a microVM's guest,
// a compromised guest kernel), even one with an empty allowlist, sends the
// first fragments of thousands of datagrams whose rest never comes. The
// host reassembles fragments before its rules see a packet (connection
// tracking needs whole ones), in the queues of the host's network
// namespace, shared by the host and every sandbox, which hold at most
// net.ipv4.ipfrag_high_thresh (4 MiB) for ipfrag_time (30 s): past that,
// every fragment that comes is dropped, whoever it is for. Expected: the
// host queues nothing of the sandbox's fragments; a large datagram from
// the outside (fragmented on the way) still reaches another sandbox, and
// one reaches the host.
func TestFragmentsQueueNothing(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, mustPolicy(t, Allowlist))
	b := attach(t, h, Policy{Mode: Internet})
	const port = 7601
	big := []byte(strings.Repeat("x", 4000))
	// The outside answers any datagram with a large one.
	echo := listenOutside(t, w, port)
	go func() {
		buf := make([]byte, 64)
		for {
			_, from, err := echo.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = echo.WriteTo(big, from)
		}
	}()
	// A service of the host's own, on its uplink address.
	host, err := net.ListenPacket("udp4", net.JoinHostPort(w.HostHTTP.Addr().String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()

	before := fragMemory(t)
	if err := sendFirstFragments(a, testutil.PublicHost, 6000); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	held := fragMemory(t) - before
	t.Logf("the host's fragment queues hold %d more bytes after a sandbox's 6,000 first fragments", held)
	if held > 64<<10 {
		t.Errorf("the host's fragment queues hold %d bytes of a sandbox's incomplete datagrams; want none", held)
	}

	// Another sandbox's large answer from the outside.
	var got int
	err = testutil.InNS(b.ns, func() error {
		c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: testutil.PublicHost.AsSlice(), Port: port})
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 8192)
		for range 3 {
			_, _ = c.Write([]byte("hi"))
			_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			if got, err = c.Read(buf); err == nil {
				return nil
			}
		}
		return err
	})
	if err != nil || got != len(big) {
		t.Errorf("another sandbox's large answer from the outside: %d bytes, %v; want %d", got, err, len(big))
	}
	// The host's own large datagram from the outside.
	err = testutil.InNS(w.Public, func() error {
		c, err := net.DialUDP("udp4", nil, host.LocalAddr().(*net.UDPAddr))
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 8192)
		for range 3 {
			_, _ = c.Write(big)
			_ = host.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			if got, _, err = host.ReadFrom(buf); err == nil {
				return nil
			}
		}
		return err
	})
	if err != nil || got != len(big) {
		t.Errorf("the host's large datagram from the outside: %d bytes, %v; want %d", got, err, len(big))
	}
}
