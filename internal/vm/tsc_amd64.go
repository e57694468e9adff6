package vm

// rdtsc reads the CPU's time-stamp counter.
func rdtsc() uint64

const haveTSC = true
