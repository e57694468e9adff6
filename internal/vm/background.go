package vm

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
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

// Foreground puts every thread of QEMU back to the normal priority (nice
// is per thread in Linux: each inherited the background value). A thread
// that a niced one makes while the threads are walked inherits the
// background value too, so the walk is repeated until it finds none left.
func (v *VM) Foreground() {
	if !v.cfg.Background {
		return
	}
	for pass := 0; pass < 8 && v.foregroundOnce() > 0; pass++ {
	}
}

// foregroundOnce renices the threads still niced and says how many.
func (v *VM) foregroundOnce() int {
	pid := v.Pid()
	tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	found := 0
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		// getpriority(2)'s raw return is 20 - nice.
		if p, err := unix.Getpriority(unix.PRIO_PROCESS, tid); err == nil && 20-p <= 0 {
			continue
		}
		if unix.Setpriority(unix.PRIO_PROCESS, tid, 0) == nil {
			found++
		}
	}
	return found
}
