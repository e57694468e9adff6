package network

import (
	"sync"
	"time"
)

// limiter is a token bucket: it allows rate events a second on average,
// and bursts of up to burst. The zero value is a full bucket.
type limiter struct {
	mu      sync.Mutex
	started bool
	tokens  float64
	last    time.Time
}

// allow takes a token if there is one.
func (l *limiter) allow(now time.Time, rate, burst float64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.started {
		l.started, l.tokens, l.last = true, burst, now
	}
	if el := now.Sub(l.last).Seconds(); el > 0 {
		l.tokens = min(burst, l.tokens+el*rate)
		l.last = now
	}
	if l.tokens < 1 {
		return false
	}
	l.tokens--
	return true
}
