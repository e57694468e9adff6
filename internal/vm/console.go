package vm

import (
	"strings"
	"sync"
)

// ConsoleBytes is how much of a guest's console the host keeps: the last
// 64 KiB, in memory. A guest that floods its console costs the host no
// more (and no disk at all).
const ConsoleBytes = 64 << 10

// Console is the end of the guest's console (its last ConsoleBytes), for
// errors and debugging.
func (v *VM) Console() string { return v.console.String() }

// ConsoleLastLine is the console's last non-empty line.
func (v *VM) ConsoleLastLine() string { return v.console.lastLine() }

// tail keeps the last max bytes written to it: QEMU's stderr, for errors,
// and the guest's console. It holds at most twice max, and moves the kept
// bytes down only when it has that much, so a flood of small writes costs
// each byte a copy or two, not one of max bytes.
type tail struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(p) >= t.max {
		t.buf = append(t.buf[:0], p[len(p)-t.max:]...)
		return len(p), nil
	}
	if len(t.buf)+len(p) > 2*t.max {
		keep := t.buf[len(t.buf)-(t.max-len(p)):]
		t.buf = append(t.buf[:0], keep...)
	}
	t.buf = append(t.buf, p...)
	return len(p), nil
}

// last is the kept bytes: the last max written.
func (t *tail) last() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf[max(0, len(t.buf)-t.max):])
}

func (t *tail) lastLine() string {
	lines := strings.Split(strings.TrimSpace(t.last()), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

func (t *tail) String() string { return t.last() }

// held is how many bytes t holds now (at most twice max).
func (t *tail) held() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.buf)
}
