package sandbox

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/cagehq/cage/internal/units"
)

// Maxima are the largest limits one sandbox may ask for. A zero field is
// the host's default (HostMaxima); a request above a maximum is refused
// with the maximum named, before anything is made.
type Maxima struct {
	Memory int64   // bytes
	Disk   int64   // bytes
	Pids   int64   // processes and threads
	CPUs   float64 // cores
}

// MaxPids is the default ceiling on a sandbox's pids: far above what a
// sandbox needs. Where the kernel's pid space is small (pid_max 32768 on
// hosts that keep the kernel's default), the ceiling is a quarter of it
// (HostMaxima): one sandbox allowed the whole space could take every pid
// of the host.
const MaxPids = 32768

var (
	hostMaxOnce sync.Once
	hostMax     Maxima
)

// HostMaxima are the defaults that fit this host: memory and disk (a tmpfs,
// RAM) up to three quarters of its RAM, as many CPUs as it has, MaxPids or
// a quarter of the kernel's pid space, whichever is fewer.
func HostMaxima() Maxima {
	hostMaxOnce.Do(func() {
		ram := HostMemory()
		if ram <= 0 {
			ram = 4 << 30 // unreadable /proc/meminfo: a small host's worth
		}
		per := ram / 4 * 3 &^ (1<<20 - 1)
		hostMax = Maxima{Memory: per, Disk: per, Pids: min(MaxPids, hostPidSpace()/4), CPUs: float64(runtime.NumCPU())}
	})
	return hostMax
}

// orHost fills m's zero fields from HostMaxima.
func (m Maxima) orHost() Maxima {
	h := HostMaxima()
	if m.Memory <= 0 {
		m.Memory = h.Memory
	}
	if m.Disk <= 0 {
		m.Disk = h.Disk
	}
	if m.Pids <= 0 {
		m.Pids = h.Pids
	}
	if m.CPUs <= 0 {
		m.CPUs = h.CPUs
	}
	return m
}

// check refuses options above m (filled from the host's defaults).
func (m Maxima) check(o *Options) error {
	m = m.orHost()
	switch {
	case o.Memory > m.Memory:
		return fmt.Errorf("%w: memory %s is above the maximum of %s per sandbox", ErrInvalid, units.HumanSize(o.Memory), units.HumanSize(m.Memory))
	case o.Disk > m.Disk:
		return fmt.Errorf("%w: disk %s is above the maximum of %s per sandbox", ErrInvalid, units.HumanSize(o.Disk), units.HumanSize(m.Disk))
	case o.Shm > o.Memory:
		return fmt.Errorf("%w: shm %s is above the sandbox's memory (%s)", ErrInvalid, units.HumanSize(o.Shm), units.HumanSize(o.Memory))
	case o.Pids > m.Pids:
		return fmt.Errorf("%w: pids %d is above the maximum of %d per sandbox", ErrInvalid, o.Pids, m.Pids)
	case o.CPUs > m.CPUs || math.IsNaN(o.CPUs) || math.IsInf(o.CPUs, 0):
		return fmt.Errorf("%w: cpus %g is above the maximum of %g per sandbox", ErrInvalid, o.CPUs, m.CPUs)
	}
	return nil
}

// HostMemory is the host's RAM in bytes (MemTotal), or 0 when unknown.
func HostMemory() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) >= 2 && string(f[0]) == "MemTotal:" {
			kb, err := strconv.ParseInt(string(f[1]), 10, 64)
			if err != nil || kb <= 0 || kb > math.MaxInt64>>10 {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

// DefaultMaxSandboxes is how many sandboxes a host runs at once when its
// operator sets no number: one per 8 MiB of RAM (an idle sandbox costs a
// few MiB of the host), at least 16.
func DefaultMaxSandboxes() int {
	return max(16, int(HostMemory()>>23))
}

// BytesOfMiB converts a count of MiB to bytes, refusing what would overflow.
func BytesOfMiB(what string, n int64) (int64, error) {
	if n < 0 || n > math.MaxInt64>>20 {
		return 0, fmt.Errorf("%w: %s %d MiB is out of range", ErrInvalid, what, n)
	}
	return n << 20, nil
}

// hostPidSpace is the kernel's pid_max (4*MaxPids where it cannot be read,
// which leaves MaxPids the ceiling).
func hostPidSpace() int64 {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		return 4 * MaxPids
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n <= 0 {
		return 4 * MaxPids
	}
	return n
}
