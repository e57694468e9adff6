package network

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/procsys"
	"github.com/cagehq/cage/internal/testutil"
)

// BenchmarkConfWrite: writing a host interface's knob with N other
// network namespaces alive that have each looked at /proc/sys/net (as
// every sandbox's does when its eth0 is configured), by the path from
// /proc/sys (the peer) and relative to the opened conf directory
// (writeConf), in the same run.
func BenchmarkConfWrite(b *testing.B) {
	testutil.RequireRoot(b)
	for _, n := range []int{0, 1000} {
		var fds []int
		for range n {
			var fd int
			if err := onThreadIn(-1, func() (err error) {
				if _, err = os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil {
					return err
				}
				fd, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
				return err
			}); err != nil {
				b.Fatal(err)
			}
			fds = append(fds, fd)
		}
		name := map[int]string{0: "alone", 1000: "1000-namespaces"}[n]
		b.Run(name+"/path", func(b *testing.B) {
			for b.Loop() {
				if err := os.WriteFile("/proc/sys/net/ipv4/conf/lo/arp_ignore", []byte("0"), 0); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/dir", func(b *testing.B) {
			for b.Loop() {
				if err := writeConf(4, "lo/arp_ignore", "0"); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/own-procfs", func(b *testing.B) {
			for b.Loop() {
				if err := procsys.Write("net/ipv4/conf/lo/arp_ignore", "0"); err != nil {
					b.Fatal(err)
				}
			}
		})
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
}
