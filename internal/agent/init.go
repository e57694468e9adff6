package agent

import (
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Duties of the agent when it is PID 1 of a sandbox, beyond reaping.

// absorbSignals keeps PID 1 alive whatever is sent to it. The kernel drops
// signals without a handler sent to a namespace's init, but the Go runtime
// installs handlers for most, and its default on SIGTERM, SIGINT, SIGHUP,
// SIGSEGV and friends is to exit. Handled (rather than ignored) signals are
// reset to their defaults in the commands the agent starts.
//
// Only the signals on which Go's handler ends the process are taken (and
// the job-control ones, which Go leaves to the kernel: from outside the
// sandbox they would stop the agent). Go's handler drops every other
// signal that nobody asked for (USR1, PIPE, ALRM, the real-time ones...),
// and asking for each of those cost a round trip to the runtime's signal
// thread: about 45 of them, a millisecond of every agent's start.
func absorbSignals() {
	ch := make(chan os.Signal, 32)
	signal.Notify(ch, absorbed...)
	go func() {
		for range ch {
		}
	}()
}

// absorbed are the signals absorbSignals takes: Go's default for each is to
// exit or crash (sigtable: _SigKill, _SigThrow, _SigPanic), or to leave it
// to the kernel (_SigDefault). SIGPIPE too: a write to a broken standard
// output or error (the host's end of the agent's stderr gone with a killed
// daemon) raises it, and Go exits on it unless someone asked for it.
var absorbed = []os.Signal{
	syscall.SIGHUP, syscall.SIGINT, syscall.SIGTERM, syscall.SIGPIPE, // exit
	syscall.SIGQUIT, syscall.SIGILL, syscall.SIGTRAP, syscall.SIGABRT, syscall.SIGSTKFLT, syscall.SIGSYS, // crash
	syscall.SIGBUS, syscall.SIGFPE, syscall.SIGSEGV, // crash when sent
	syscall.SIGCONT, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU, // the kernel's default
}

// reserveThreads makes the Go runtime start OS threads now, until the agent
// has total; the runtime keeps them idle for later. The sandbox's workload
// shares the agent's pids cgroup: once it has used every pid the runtime
// could not start a thread and would abort, so the agent takes what it needs
// before serving. The host adds total to the pids limit, so the workload's
// budget is what was asked. Each held goroutine pins a thread; a new one
// takes an idle thread or makes the runtime start another. The count is
// read once per batch (as many pins as threads are missing), not once per
// pin: reading /proc/self/status was most of the time this took, and it
// is on the way to a sandbox's first command.
func reserveThreads(total int) {
	release := make(chan struct{})
	var done sync.WaitGroup
	for pinned := 0; pinned < 4*total; {
		missing := min(total-threadCount(), 4*total-pinned)
		if missing <= 0 {
			break
		}
		for range missing {
			started := make(chan struct{})
			done.Add(1)
			go func() {
				defer done.Done()
				runtime.LockOSThread()
				close(started)
				<-release
				runtime.UnlockOSThread()
			}()
			<-started
		}
		pinned += missing
	}
	close(release)
	done.Wait()
}

func threadCount() int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}
