package inside

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

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

// LimitSocketOptions sets the calling thread's network namespace's
// optmem_max (OptMemMax) through proc, the sandbox's own /proc before its
// /proc/sys is made read-only (MountProc): through the host's /proc, each
// sandbox's write lengthened the walk of every later one, the host's
// included (procsys). A kernel without the per-namespace knob is left as
// it is.
func LimitSocketOptions(proc string) error {
	err := os.WriteFile(filepath.Join(proc, "sys/net/core/optmem_max"), []byte(strconv.Itoa(OptMemMax)), 0)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("net.core.optmem_max: %w", err)
	}
	return nil
}
