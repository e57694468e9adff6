package jupyter

import (
	"strings"
	"sync"
	"syscall"

	"github.com/go-zeromq/zmq4"
)

// ExitError says the kernel process ended on its own.
type ExitError struct {
	Status string // "exit status 1", "signal: killed"
	Stderr string // the end of what it wrote
}

func (e *ExitError) Error() string {
	msg := "the kernel exited (" + e.Status + ")"
	if e.Stderr != "" {
		msg += ": " + e.Stderr
	}
	return msg
}

// exitError describes how p ended.
func (k *Kernel) exitError(p *proc) error {
	<-p.done
	if p.stopped.Load() {
		return ErrRestarted
	}
	status := "exit status 0"
	if p.waitErr != nil {
		status = p.waitErr.Error()
	}
	return &ExitError{Status: status, Stderr: p.out.String()}
}

// Exited says whether the kernel process ended on its own, and how.
func (k *Kernel) Exited() error {
	k.mu.Lock()
	p := k.p
	k.mu.Unlock()
	if p == nil {
		return ErrRestarted
	}
	select {
	case <-p.done:
		return k.exitError(p)
	default:
		return nil
	}
}

// kill ends p and everything it started, and closes its sockets.
func (k *Kernel) kill(p *proc) {
	p.stopped.Store(true)
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
	p.cancel()
	for _, s := range []zmq4.Socket{p.shell, p.control, p.iopub} {
		if s != nil {
			_ = s.Close()
		}
	}
}

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.b))
	if i := strings.LastIndex(s, "\n"); len(s) > 600 && i >= 0 {
		s = s[i+1:] // the last line says most
	}
	if len(s) > 600 {
		s = s[len(s)-600:]
	}
	return s
}
