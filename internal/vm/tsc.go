package vm

import (
	"slices"
	"sync"
	"time"
)

// hostTSCkHz is the frequency of the host's time-stamp counter in kHz, 0
// when unknown. Measured once, over about 20 ms.
//
// Under TCG the guest's TSC is the host's, and the guest needs its
// frequency told: it cannot measure it, since microvm has none of the
// references Linux calibrates against (PIT channel 2 via port 0x61, HPET,
// ACPI PM timer). Without it Linux falls back to counting timer ticks that,
// under TCG on microvm, often never come, and hangs in early boot.
var hostTSCkHz = sync.OnceValue(func() uint64 {
	if !haveTSC {
		return 0
	}
	var rates []float64
	for range 5 {
		t0, c0 := rdtsc(), time.Now()
		time.Sleep(4 * time.Millisecond)
		t1, c1 := rdtsc(), time.Now()
		if d := c1.Sub(c0); d > 0 && t1 > t0 {
			rates = append(rates, float64(t1-t0)/float64(d.Nanoseconds())*1e6)
		}
	}
	if len(rates) == 0 {
		return 0
	}
	// The median: a sample the scheduler interrupted between the two reads
	// is off either way.
	slices.Sort(rates)
	return uint64(rates[len(rates)/2])
})
