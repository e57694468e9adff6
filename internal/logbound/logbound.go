// Package logbound bounds the log lines that anyone who reaches a
// listener can cause (a failed handshake, a forward to a node that does
// not answer): at most one a key per interval, the next one written
// saying how many were left out. The daemon's listeners and standard
// logger (internal/daemon) and the cluster front's forwards
// (internal/cluster) share it.
package logbound

import (
	"sync"
	"time"
)

// maxKeys bounds the keys a Limiter remembers; past it (after those idle
// for an interval are let go) new keys share one.
const maxKeys = 1024

// Limiter lets through at most one line a key per Every (0: a second).
// The zero value is ready.
type Limiter struct {
	Every time.Duration

	mu   sync.Mutex
	keys map[string]*last
}

type last struct {
	at      time.Time // the last line let through
	skipped int       // lines held back since
}

// Allow reports whether a line for key may be written now and, when it
// may, how many lines for key were held back since the last one.
func (l *Limiter) Allow(key string) (ok bool, skipped int) {
	every := l.Every
	if every <= 0 {
		every = time.Second
	}
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		l.keys = map[string]*last{}
	}
	s := l.keys[key]
	if s == nil {
		if len(l.keys) >= maxKeys {
			for k, o := range l.keys {
				if now.Sub(o.at) >= every && o.skipped == 0 {
					delete(l.keys, k)
				}
			}
		}
		if len(l.keys) >= maxKeys {
			key = "\x00overflow"
		}
		if s = l.keys[key]; s == nil {
			s = &last{}
			l.keys[key] = s
		}
	}
	if !s.at.IsZero() && now.Sub(s.at) < every {
		s.skipped++
		return false, 0
	}
	skipped, s.at, s.skipped = s.skipped, now, 0
	return true, skipped
}
