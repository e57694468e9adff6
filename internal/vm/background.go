package vm

import (
	"fmt"
	"os/exec"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/hostproc"
)

// BackgroundNice is the priority of a VM started with Config.Background
// (a pool's, made ahead of its request), QEMU's every thread, until
// Foreground: as the other walls' pools make their sandboxes.
const BackgroundNice = 15

// A background QEMU is started from one OS thread kept at BackgroundNice
// for the life of the process: a child inherits its starter's priority,
// and QEMU's parent-death signal is tied to the thread that started it,
// so that thread may never end (a thread made for each start would kill
// its QEMU as it ended).
var (
	bgOnce   sync.Once
	bgStarts chan bgStart
)

type bgStart struct {
	cmd  *exec.Cmd
	done chan error
}

// startAt starts cmd, at BackgroundNice when background is set.
func startAt(cmd *exec.Cmd, background bool) error {
	if !background {
		return cmd.Start()
	}
	bgOnce.Do(func() {
		bgStarts = make(chan bgStart)
		ready := make(chan struct{})
		go func() {
			runtime.LockOSThread() // never unlocked: the thread lives as long as the process
			err := unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), BackgroundNice)
			close(ready)
			for s := range bgStarts {
				if err != nil {
					s.done <- fmt.Errorf("background priority: %w", err)
					continue
				}
				s.done <- s.cmd.Start()
			}
		}()
		<-ready
	})
	s := bgStart{cmd: cmd, done: make(chan error, 1)}
	bgStarts <- s
	return <-s.done
}

// Foreground puts every thread of QEMU back to the normal priority (each
// inherited the background value).
func (v *VM) Foreground() {
	if !v.cfg.Background {
		return
	}
	hostproc.Foreground(v.Pid())
}
