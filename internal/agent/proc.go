package agent

import (
	"errors"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	pb "github.com/cagehq/cage/api/gen/process"
)

// proc is one process the agent started: its output fans out to every
// attached stream, its input comes from SendInput/StreamInput.
type proc struct {
	pid    int
	tag    string
	config *pb.ProcessConfig

	stdin io.WriteCloser // nil when the process has no stdin pipe
	pty   *os.File       // PTY master, nil without a PTY

	maxOutput int64
	oomBase   uint64 // OOM-kill counter when the process started
	pidsBase  uint64 // pids-limit counter when the process started

	exited chan syscall.WaitStatus // receives the wait status once

	mu        sync.Mutex
	subs      map[*sub]struct{}
	sent      int64
	truncated bool
	timedOut  bool
	end       *pb.ProcessEvent // set once the process has ended and output drained
	done      chan struct{}    // closed after end is set
	inputMu   sync.Mutex       // orders writes to stdin/pty
}

func newProc(cfg *pb.ProcessConfig, tag string, maxOutput int64) *proc {
	return &proc{
		config:    cfg,
		tag:       tag,
		maxOutput: maxOutput,
		exited:    make(chan syscall.WaitStatus, 1),
		subs:      map[*sub]struct{}{},
		done:      make(chan struct{}),
	}
}

// sub is one attached stream. events closes after the end event; gone
// closes when the stream's client leaves, so a publisher never blocks on it.
type sub struct {
	events chan *pb.ProcessEvent
	gone   chan struct{}
}

// subscribe attaches a stream. One that attaches after the end gets only the
// end event.
func (p *proc) subscribe() *sub {
	s := &sub{events: make(chan *pb.ProcessEvent, 16), gone: make(chan struct{})}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		s.events <- p.end
		close(s.events)
		return s
	}
	p.subs[s] = struct{}{}
	return s
}

// unsubscribe detaches a stream whose client went away.
func (p *proc) unsubscribe(s *sub) {
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
	close(s.gone)
}

// publish delivers ev to every subscriber, waiting for slow ones: a slow
// reader slows the process down (pipe back-pressure) instead of growing memory.
func (p *proc) publish(ev *pb.ProcessEvent) {
	p.mu.Lock()
	subs := make([]*sub, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.events <- ev:
		case <-s.gone:
		}
	}
}

// output forwards one chunk, honouring the output cap.
func (p *proc) output(kind int, b []byte) {
	p.mu.Lock()
	room := p.maxOutput - p.sent
	if room <= 0 {
		p.truncated = true
		p.mu.Unlock()
		return
	}
	if int64(len(b)) > room {
		b = b[:room]
		p.truncated = true
	}
	p.sent += int64(len(b))
	p.mu.Unlock()

	data := &pb.ProcessEvent_DataEvent{}
	chunk := append([]byte(nil), b...)
	switch kind {
	case outStdout:
		data.Output = &pb.ProcessEvent_DataEvent_Stdout{Stdout: chunk}
	case outStderr:
		data.Output = &pb.ProcessEvent_DataEvent_Stderr{Stderr: chunk}
	default:
		data.Output = &pb.ProcessEvent_DataEvent_Pty{Pty: chunk}
	}
	p.publish(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: data}})
}

const (
	outStdout = iota
	outStderr
	outPTY
)

// pump copies one output stream until EOF, or until the process has exited
// and drainGrace has passed: a grandchild that keeps the pipe open must not
// keep the command from ending. wg is done when the output is complete.
func (p *proc) pump(f *os.File, kind int, wg *sync.WaitGroup, exitedAt <-chan struct{}) {
	buf := make([]byte, 32<<10)
	go func() {
		<-exitedAt
		_ = f.SetReadDeadline(time.Now().Add(drainGrace))
	}()
	for {
		n, err := f.Read(buf)
		if n > 0 {
			p.output(kind, buf[:n])
		}
		if err == nil {
			continue
		}
		if kind == outPTY {
			// A PTY master reads EIO whenever no process holds the
			// terminal open, which coreutils programs cause as they exit
			// (they close stdout first). Closing the master then would hang
			// the terminal up and kill them with SIGHUP: wait for the exit.
			<-exitedAt
		} else if errors.Is(err, os.ErrDeadlineExceeded) {
			// A background child (a daemon the command started, a
			// browser xdg-open started) still holds the pipe. The end
			// goes out now and later output is dropped, but the pipe is
			// read on until its last holder closes it: closed, the
			// child's next write would kill it (SIGPIPE); unread, the
			// child would block once the pipe's buffer filled.
			wg.Done()
			discardUntilEOF(f)
			f.Close()
			return
		}
		f.Close()
		wg.Done()
		return
	}
}

// discardUntilEOF reads f until it ends.
func discardUntilEOF(f *os.File) {
	_ = f.SetReadDeadline(time.Time{})
	buf := make([]byte, 4<<10)
	for {
		if _, err := f.Read(buf); err != nil {
			return
		}
	}
}

// drainGrace is how long output is still collected after the process exited
// while something else (a background grandchild) holds its pipes open.
const drainGrace = 50 * time.Millisecond

// finish records the end event and releases every subscriber.
func (p *proc) finish(end *pb.ProcessEvent_EndEvent) {
	p.mu.Lock()
	end.Truncated = p.truncated
	if p.truncated {
		msg := "output truncated: the process wrote more than the output limit"
		if end.Error == nil {
			end.Error = &msg
		}
	}
	ev := &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: end}}
	p.end = ev
	subs := p.subs
	p.subs = map[*sub]struct{}{}
	p.mu.Unlock()
	for s := range subs {
		select {
		case s.events <- ev:
		case <-s.gone:
		}
		close(s.events)
	}
	close(p.done)
}

// writeInput sends bytes to the process's stdin or PTY.
func (p *proc) writeInput(in *pb.ProcessInput) error {
	p.inputMu.Lock()
	defer p.inputMu.Unlock()
	switch {
	case in.GetPty() != nil:
		if p.pty == nil {
			return errors.New("the process has no PTY")
		}
		_, err := p.pty.Write(in.GetPty())
		return err
	case in.GetStdin() != nil:
		if p.pty != nil {
			_, err := p.pty.Write(in.GetStdin())
			return err
		}
		if p.stdin == nil {
			return errors.New("the process was started without stdin")
		}
		_, err := p.stdin.Write(in.GetStdin())
		return err
	}
	return nil
}

func (p *proc) closeStdin() error {
	p.inputMu.Lock()
	defer p.inputMu.Unlock()
	if p.pty != nil {
		return errors.New("the process has a PTY: send Ctrl-D (0x04) instead")
	}
	if p.stdin == nil {
		return nil
	}
	err := p.stdin.Close()
	p.stdin = nil
	return err
}

// signal sends sig to the process's whole process group.
func (p *proc) signal(sig syscall.Signal) error {
	err := syscall.Kill(-p.pid, sig)
	if err == syscall.ESRCH {
		err = syscall.Kill(p.pid, sig)
	}
	if err == syscall.ESRCH {
		return nil // already gone
	}
	return err
}
