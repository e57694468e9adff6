package sandbox

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
)

// The kernel has limits that are global to the host, which every sandbox
// draws from: the pid space (kernel.pid_max), the count of threads
// (kernel.threads-max), of open files (fs.file-max) and of ptys in every
// devpts instance but the host's (kernel.pty.max). A sandbox's cgroups
// bound what it holds of each (its pids limit; its memory, to which the
// kernel charges each task, open file and pty) and each sandbox's devpts
// has a limit of its own (inside.MaxPtys), but the kernel's defaults on a
// host without systemd are far below what a daemon's sandboxes may hold
// together: pid_max 32768 against 512 pids a sandbox and thousands of
// sandboxes, file-max a tenth of RAM in KiB against 65,536 files a
// process. One tenant could then exhaust one of them, and every other
// sandbox (and the host's unprivileged processes) would fail to fork,
// open or get a terminal (found by review, 2026-12-03: one sandbox held
// 1.2 million open files, half the host's file-max, in 25 s). The daemon
// raises each to what systemd sets, or to what the sandboxes' own limits
// already bound, so that what bounds a tenant is its sandboxes' cgroups.

// HostLimit is one of the kernel's global limits and the least value the
// daemon gives it.
type HostLimit struct {
	Sysctl string // as sysctl(8) names it
	Path   string
	Min    int64
}

// HostLimits are the limits RaiseHostLimits raises.
var HostLimits = []HostLimit{
	{"kernel.pid_max", "/proc/sys/kernel/pid_max", 4194304},         // the kernel's most on 64 bits; systemd's
	{"kernel.threads-max", "/proc/sys/kernel/threads-max", 4194304}, // as many as there are pids
	{"fs.file-max", "/proc/sys/fs/file-max", 1 << 62},               // each file is charged to its cgroup's memory
	{"kernel.pty.max", "/proc/sys/kernel/pty/max", 1 << 20},         // the kernel's most: 4,096 sandboxes at inside.MaxPtys
	// The neighbour tables hold every namespace's entries (two a
	// networked sandbox, its veth's ends): at 1,024 a host of 512 busy
	// sandboxes could resolve no new neighbour. The hard limit first:
	// thresh2 may not exceed it.
	{"net.ipv4.neigh.default.gc_thresh3", "/proc/sys/net/ipv4/neigh/default/gc_thresh3", 65536},
	{"net.ipv4.neigh.default.gc_thresh2", "/proc/sys/net/ipv4/neigh/default/gc_thresh2", 32768},
	{"net.ipv6.neigh.default.gc_thresh3", "/proc/sys/net/ipv6/neigh/default/gc_thresh3", 65536},
	{"net.ipv6.neigh.default.gc_thresh2", "/proc/sys/net/ipv6/neigh/default/gc_thresh2", 32768},
}

// RaiseHostLimits raises each of HostLimits that is below its least value
// and says what it did; one it cannot raise (a read-only /proc/sys in a
// container) is a warning: each sandbox is bounded all the same, the host
// in all less well. It must run before HostMaxima is first read (the pids
// ceiling follows the pid space).
func RaiseHostLimits(log *slog.Logger) {
	for _, l := range HostLimits {
		was, err := readSysctl(l.Path)
		if errors.Is(err, os.ErrNotExist) {
			continue // not on this kernel (IPv6 off)
		}
		if err != nil {
			log.Warn("host limit unreadable", "sysctl", l.Sysctl, "err", err)
			continue
		}
		if was >= l.Min {
			continue
		}
		if err := os.WriteFile(l.Path, []byte(strconv.FormatInt(l.Min, 10)), 0); err != nil {
			log.Warn("host limit left low: one tenant's sandboxes could use it up for all", "sysctl", l.Sysctl, "value", was, "want", l.Min, "err", err)
			continue
		}
		log.Info("raised a host-wide kernel limit so that sandboxes are bounded by their own cgroups", "sysctl", l.Sysctl, "from", was, "to", l.Min)
	}
}

// LowHostLimits lists the limits below their least value (for cage doctor).
func LowHostLimits() []string {
	var out []string
	for _, l := range HostLimits {
		if v, err := readSysctl(l.Path); (err != nil && !errors.Is(err, os.ErrNotExist)) || (err == nil && v < l.Min) {
			out = append(out, fmt.Sprintf("%s=%d (want %d)", l.Sysctl, v, l.Min))
		}
	}
	return out
}

func readSysctl(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}
