// Package stats summarises timing samples as percentiles, for benchmarks
// anywhere (internal/bench and the walls' own).
package stats

import (
	"fmt"
	"sort"
	"time"
)

// Stats summarises samples.
type Stats struct {
	N                  int
	Min, P50, P95, P99 time.Duration
	Max                time.Duration
}

// Summarize computes percentiles (nearest rank).
func Summarize(samples []time.Duration) Stats {
	if len(samples) == 0 {
		return Stats{}
	}
	s := append([]time.Duration(nil), samples...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	pct := func(p float64) time.Duration {
		i := int(p*float64(len(s))+0.999999) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return Stats{N: len(s), Min: s[0], P50: pct(0.50), P95: pct(0.95), P99: pct(0.99), Max: s[len(s)-1]}
}

func (s Stats) String() string {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d.Microseconds())/1000) }
	return fmt.Sprintf("n=%d p50=%sms p95=%sms p99=%sms min=%sms max=%sms", s.N, ms(s.P50), ms(s.P95), ms(s.P99), ms(s.Min), ms(s.Max))
}

// Ratio is a's median over b's.
func Ratio(a, b Stats) float64 {
	if b.P50 == 0 {
		return 0
	}
	return float64(a.P50) / float64(b.P50)
}
