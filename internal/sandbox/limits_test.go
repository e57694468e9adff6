package sandbox

import (
	"errors"
	"testing"
)

// TestHostMaximaPids: by default no sandbox may hold more than a quarter of
// the kernel's pid space (on a host with the kernel's default pid_max,
// 32768, MaxPids alone was all of it: one sandbox could take every pid of
// the host), nor more than MaxPids; the default fits under it, and a create
// asking for more is refused with a line naming the maximum.
func TestHostMaximaPids(t *testing.T) {
	m := HostMaxima()
	space := hostPidSpace()
	if m.Pids > space/4 || m.Pids > MaxPids {
		t.Errorf("HostMaxima().Pids = %d with pid_max %d; want at most a quarter of it and at most %d", m.Pids, space, MaxPids)
	}
	if m.Pids < DefaultPids {
		t.Errorf("HostMaxima().Pids = %d, under the default %d", m.Pids, DefaultPids)
	}
	err := Maxima{}.check(&Options{Pids: m.Pids + 1, Memory: DefaultMemory, Disk: DefaultDisk, CPUs: DefaultCPUs})
	if !errors.Is(err, ErrInvalid) {
		t.Errorf("a create asking for %d pids: %v; want refused", m.Pids+1, err)
	}
}
