package microvm

import (
	"testing"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/wall"
)

// TestVMSizeClasses: a VM's RAM from a memory limit comes in few sizes,
// never less than the limit and its guest overhead: every limit from 1 MiB
// to 4 GiB, MiB by MiB, makes 44 shapes (each shape is a snapshot, on disk
// and in the daemon's memory; before, one per limit: 4,096).
func TestVMSizeClasses(t *testing.T) {
	sizes := map[int]bool{}
	for mib := int64(1); mib <= 4<<10; mib++ {
		mem, _ := vmSize(Config{Spec: wall.Spec{Limits: cgroups.Limits{MemoryBytes: mib << 20}}})
		if mem < int(mib)+GuestOverheadMB {
			t.Fatalf("a limit of %d MiB: a VM of %d MiB", mib, mem)
		}
		sizes[mem] = true
	}
	if len(sizes) > 44 {
		t.Errorf("%d VM sizes for the limits up to 4 GiB, want at most 44", len(sizes))
	}
	for _, c := range []struct{ limit, want int }{{64, 192}, {512, 640}, {513, 704}, {1 << 10, 1280}, {8 << 10, 9 << 10}, {10 << 10, 11 << 10}} {
		if mem, _ := vmSize(Config{Spec: wall.Spec{Limits: cgroups.Limits{MemoryBytes: int64(c.limit) << 20}}}); mem != c.want {
			t.Errorf("a limit of %d MiB: a VM of %d MiB, want %d", c.limit, mem, c.want)
		}
	}
	if mem, _ := vmSize(Config{MemoryMB: 300}); mem != 300 {
		t.Errorf("a VM sized by MemoryMB 300: %d MiB", mem)
	}
}
