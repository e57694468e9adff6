//go:build !amd64

package vm

func rdtsc() uint64 { return 0 }

const haveTSC = false
