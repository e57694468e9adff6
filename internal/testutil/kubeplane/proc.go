package kubeplane

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"time"
)

// The parent-death signal (Pdeathsig) is sent when the thread that forked
// the child exits, not the process: a goroutine that locks its thread and
// ends locked (as a test that enters a network namespace does) takes the
// thread with it, and would kill the plane. Processes are therefore forked
// from one thread kept for the process's life.
var (
	forkOnce sync.Once
	forks    chan func()
)

// StartProcess starts cmd from the kept thread, so that a Pdeathsig in
// cmd.SysProcAttr fires only when this process ends.
func StartProcess(cmd *exec.Cmd) error {
	forkOnce.Do(func() {
		forks = make(chan func())
		go func() {
			runtime.LockOSThread() // never unlocked: this thread stays
			for f := range forks {
				f()
			}
		}()
	})
	done := make(chan error, 1)
	forks <- func() { done <- cmd.Start() }
	return <-done
}

// proc is one process of the plane; its output goes to DIR/NAME.log.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logFile string
	done    chan struct{}
}

// run starts a process that dies with the caller (Pdeathsig) in a process
// group of its own.
func (p *Plane) run(path, name string, extra io.Writer, args ...string) error {
	logFile := filepath.Join(p.Dir, name+".log")
	f, err := os.Create(logFile)
	if err != nil {
		return err
	}
	cmd := exec.Command(path, args...)
	var out io.Writer = f
	if extra != nil {
		out = io.MultiWriter(f, extra)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := StartProcess(cmd); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	pr := &proc{name: name, cmd: cmd, logFile: logFile, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(pr.done)
	}()
	p.procs = append(p.procs, pr)
	return nil
}

func (pr *proc) exited() bool {
	select {
	case <-pr.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the process group, SIGKILL after 10 s, and waits.
func (pr *proc) stop() {
	if pr.exited() {
		return
	}
	pgid := pr.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-pr.done:
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-pr.done
	}
	_ = syscall.Kill(-pgid, syscall.SIGKILL) // anything it left in its group
}

// tail returns the end of the process's log.
func (pr *proc) tail() string {
	data, _ := os.ReadFile(pr.logFile)
	if len(data) > 3000 {
		data = data[len(data)-3000:]
	}
	return string(data)
}
