package network

import (
	"net"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// Attack: the host runs a daemon that asked for packets with the Router
// Alert option (IP_ROUTER_ALERT: multicast routing, IGMP proxies, RSVP);
// a sandbox with an empty allowlist sends UDP datagrams with that option
// (a plain socket's IP_OPTIONS: no raw socket needed) towards a public
// address. The kernel hands a forwarded packet with the option to such
// sockets before the forward hook, where every rule of cage's is.
// Expected: the host's socket gets nothing of the sandbox's.
func TestRouterAlertReachesNoHostSocket(t *testing.T) {
	w := testutil.NewWorld(t)
	h := newHost(t, w, nil)
	a := attach(t, h, mustPolicy(t, Allowlist))
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_ROUTER_ALERT, 1); err != nil {
		t.Fatal(err)
	}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 500000})
	err = testutil.InNS(a.ns, func() error {
		c, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: testutil.PublicHost.AsSlice(), Port: 7700})
		if err != nil {
			return err
		}
		defer c.Close()
		raw, err := c.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := raw.Control(func(f uintptr) {
			// Router Alert: type 148, length 4, value 0.
			serr = unix.SetsockoptString(int(f), unix.IPPROTO_IP, unix.IP_OPTIONS, string([]byte{148, 4, 0, 0}))
		}); err != nil {
			return err
		}
		if serr != nil {
			return serr
		}
		for range 3 {
			_, _ = c.Write([]byte("to the host's router-alert socket"))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2048)
	if n, _, err := unix.Recvfrom(fd, buf, 0); err == nil {
		t.Errorf("the host's router-alert socket got %d bytes of an empty allowlist's sandbox: %q", n, buf[:n])
	}
}
