package interp

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

// childProc is a kernel process of cage's own: requests go to its fd 3,
// messages (JSON lines) come from its fd 4, and what its children write
// straight to its stdout and stderr is the run's output too.
type childProc struct {
	cmd     *exec.Cmd
	req     *os.File
	msgs    chan []byte // closed at the end of fd 4
	done    chan struct{}
	waitErr error
	stopped atomic.Bool
	tail    *stderrTail
	mark    []byte    // "\x1e" + nonce + ":", the start of an end-of-output mark (nil: none)
	marks   chan mark // the marks seen

	mu  sync.Mutex
	out Output // the run in progress's
}

// startChild starts cmd in dir in a process group of its own.
func startChild(cmd *exec.Cmd, dir string, markStart []byte) (*childProc, error) {
	var files []*os.File // the child's ends, closed once it has them
	pipe := func() (r, w *os.File, err error) {
		if r, w, err = os.Pipe(); err == nil {
			files = append(files, r, w)
		}
		return r, w, err
	}
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	reqR, reqW, err1 := pipe()
	msgR, msgW, err2 := pipe()
	outR, outW, err3 := pipe()
	errR, errW, err4 := pipe()
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		closeAll()
		return nil, err
	}
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = outW, errW
	cmd.ExtraFiles = []*os.File{reqR, msgW}
	// A group of its own (interrupts and kills reach what it started); it
	// dies with this server (a server started again knows nothing of it).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	p := &childProc{cmd: cmd, req: reqW, msgs: make(chan []byte, 64), done: make(chan struct{}), tail: &stderrTail{},
		mark: markStart, marks: make(chan mark, 16)}
	if err := cmd.Start(); err != nil {
		closeAll()
		return nil, err
	}
	for _, f := range []*os.File{reqR, msgW, outW, errW} {
		f.Close()
	}
	go p.copyRaw("stdout", outR)
	go p.copyRaw("stderr", errR)
	go func() {
		defer close(p.msgs)
		defer msgR.Close()
		r := bufio.NewReaderSize(msgR, 64<<10)
		for {
			line, err := r.ReadBytes('\n')
			if len(line) > 0 {
				select {
				case p.msgs <- line:
				case <-p.done:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	go func() {
		p.waitErr = cmd.Wait()
		p.signal(syscall.SIGKILL) // what it started
		reqW.Close()
		close(p.done)
	}()
	return p, nil
}

// copyRaw hands what the process's children write to its stdout or stderr
// to the run in progress (nobody's output between runs). Where the process
// marks the end of a run's output (bash), the marks are taken out of the
// text and reported on p.marks.
func (p *childProc) copyRaw(name string, r io.ReadCloser) {
	defer r.Close()
	buf := make([]byte, 32<<10)
	var pending []byte // an incomplete mark or UTF-8 sequence
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if name == "stderr" {
				_, _ = p.tail.Write(buf[:n])
			}
			data := append(pending, buf[:n]...)
			pending = nil
			if p.mark != nil {
				data, pending = p.takeMarks(name, data)
			}
			data, rest := splitUTF8(data)
			pending = append(pending, rest...)
			p.emit(name, data)
		}
		if err != nil {
			p.emit(name, pending)
			return
		}
	}
}

func (p *childProc) emit(name string, text []byte) {
	if len(text) == 0 {
		return
	}
	p.mu.Lock()
	if p.out != nil {
		p.out.Stream(name, string(text), time.Now())
	}
	p.mu.Unlock()
}

// mark is the end of run seq's output on one stream.
type mark struct {
	stream string
	seq    int
}

// takeMarks emits the text before each mark "\x1e<p.mark><seq>\x1e" in
// data, reports the mark, and returns the text after the last one and what
// may be the start of a mark (held back until more is read).
func (p *childProc) takeMarks(name string, data []byte) (text, held []byte) {
	for {
		i := bytes.Index(data, p.mark)
		if i < 0 {
			break
		}
		j := bytes.IndexByte(data[i+len(p.mark):], 0x1e)
		if j < 0 || j > 20 {
			if j < 0 && len(data)-i < 64 {
				return data[:i], data[i:]
			}
			p.emit(name, data[:i+1])
			data = data[i+1:]
			continue
		}
		seq, err := strconv.Atoi(string(data[i+len(p.mark) : i+len(p.mark)+j]))
		p.emit(name, data[:i])
		data = data[i+len(p.mark)+j+1:]
		if err == nil {
			select {
			case p.marks <- mark{name, seq}:
			case <-p.done:
			}
		}
	}
	if k := bytes.LastIndexByte(data, 0x1e); k >= 0 && bytes.HasPrefix(p.mark, data[k:]) {
		return data[:k], data[k:]
	}
	return data, nil
}

func (p *childProc) setOutput(out Output) {
	p.mu.Lock()
	p.out = out
	p.mu.Unlock()
}

func (p *childProc) signal(sig syscall.Signal) { _ = syscall.Kill(-p.cmd.Process.Pid, sig) }

// kill ends the process and its children.
func (p *childProc) kill() {
	p.stopped.Store(true)
	p.signal(syscall.SIGKILL)
	<-p.done
}

// exited is nil while the process runs, else how it ended.
func (p *childProc) exited() error {
	select {
	case <-p.done:
		return p.exitError()
	default:
		return nil
	}
}

func (p *childProc) exitError() error {
	<-p.done
	if p.stopped.Load() {
		return jupyter.ErrRestarted
	}
	status := "exit status 0"
	if p.waitErr != nil {
		status = p.waitErr.Error()
	}
	return &jupyter.ExitError{Status: status, Stderr: p.tail.String()}
}

// splitUTF8 splits b before an incomplete UTF-8 sequence at its end.
func splitUTF8(b []byte) (whole, rest []byte) {
	for i := len(b) - 1; i >= 0 && i >= len(b)-3; i-- {
		c := b[i]
		if c < 0x80 {
			break
		}
		if c >= 0xC0 { // a sequence's first byte: is the sequence complete?
			need := 2
			if c >= 0xF0 {
				need = 4
			} else if c >= 0xE0 {
				need = 3
			}
			if len(b)-i < need {
				return b[:i], append([]byte(nil), b[i:]...)
			}
			break
		}
	}
	return b, nil
}

// stderrTail keeps the end of a kernel's stderr, for why it died.
type stderrTail struct {
	mu sync.Mutex
	b  []byte
}

func (t *stderrTail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 1024 {
		t.b = append(t.b[:0], t.b[len(t.b)-1024:]...)
	}
	return len(p), nil
}

func (t *stderrTail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}
