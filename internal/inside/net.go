package inside

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// LoopbackUp is a child-side step the OCI walls' agent uses too: a new
// network namespace starts with a loopback interface that is down; bring it
// up. Nothing else exists: no route out.
func LoopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	ifr.SetUint16(unix.IFF_UP | unix.IFF_LOOPBACK | unix.IFF_RUNNING)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}

// OptMemMax is the sandbox's network namespace's net.core.optmem_max: the
// most kernel memory one socket may hold for its options (multicast
// groups, IP options, filters), which is charged to no cgroup. A new
// namespace gets 128 KiB on this kernel; 20 KiB is what Linux gave before
// 6.8. The options that could hold far more are denied outright
// (seccomp: TCP MD5/AO keys, IPv6 flow labels).
const OptMemMax = 20480

// MaxTimeWait is the sandbox's network namespace's
// net.ipv4.tcp_max_tw_buckets: the most TCP connections (IPv4 and IPv6)
// it closed that wait out TIME_WAIT at once; one closed past it skips the
// wait. Each waits 60 s as some 330 bytes of the host's kernel memory
// charged to no cgroup (the kernel makes it where no task's group is
// known), and a new namespace's default is half the host's TCP hash
// (131,072 here, more with more RAM): found by review, 2026-12-05, one
// sandbox of 256 MiB held 78,500 (+19 MiB of the host's unreclaimable
// slab, 1 MiB in its own group) from 120,000 loopback connections in 7 s,
// and could hold 43 MiB. As many as a sandbox may have open connections
// tracked by the host.
const MaxTimeWait = 4096

// NetSysctls are the sysctls of a sandbox's network namespace that bound
// what its sockets keep of the host's memory outside its cgroup, as
// sysctl(8) names them, with their values.
var NetSysctls = map[string]string{
	"net.core.optmem_max":         strconv.Itoa(OptMemMax),
	"net.ipv4.tcp_max_tw_buckets": strconv.Itoa(MaxTimeWait),
}

// LimitSocketMemory sets NetSysctls in the calling thread's network
// namespace through proc, the sandbox's own /proc before its /proc/sys is
// made read-only (MountProc): through the host's /proc, each sandbox's
// write lengthened the walk of every later one, the host's included
// (procsys). A kernel without a per-namespace knob is left as it is.
func LimitSocketMemory(proc string) error {
	for name, v := range NetSysctls {
		err := os.WriteFile(filepath.Join(proc, "sys", strings.ReplaceAll(name, ".", "/")), []byte(v), 0)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	return nil
}
