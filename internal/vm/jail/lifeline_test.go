package jail

import (
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestHostThereUnderSignals: the jailer's check that the host still holds
// the lifeline answers "there" however many signals its thread takes (the
// Go runtime preempts a goroutine that ran long with SIGURG, as on a
// loaded host), and "went away" once the host's end is closed. Before, a
// signal during the poll (EINTR) read as the host's going: a microVM
// failed to start now and then in CI with "jail: the host went away"
// (seen in TestStallReportVM and TestHostileWorkloads/microvm). Here a
// second thread sends the polling thread SIGURG without pause until a bare
// poll beside the checks has been interrupted 50 times (about a second).
func TestHostThereUnderSignals(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fd := int(r.Fd())

	tids := make(chan int)
	done := make(chan struct{})
	var calls, failures, interrupted int
	var first error
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tids <- unix.Gettid()
		// A bare poll beside each check counts how often the signals
		// do interrupt one: the checks meet as many interruptions.
		raw := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for end := time.Now().Add(10 * time.Second); interrupted < 50 && time.Now().Before(end); {
			if _, err := unix.Poll(raw, 0); err == unix.EINTR {
				interrupted++
			}
			calls++
			if err := hostThere(fd); err != nil {
				if failures++; first == nil {
					first = err
				}
			}
		}
	}()
	tid, pid := <-tids, os.Getpid()
	go func() {
		for {
			select {
			case <-done:
				return
			default:
				_ = unix.Tgkill(pid, tid, unix.SIGURG)
			}
		}
	}()
	<-done
	t.Logf("%d checks; %d bare polls beside them interrupted", calls, interrupted)
	if interrupted == 0 {
		t.Errorf("no poll was interrupted in 10 s: the test did not make the case it is about")
	}
	if failures > 0 {
		t.Errorf("the host was there, but %d of %d checks under signals said otherwise; the first: %v", failures, calls, first)
	}

	w.Close()
	if err := hostThere(fd); err == nil || !strings.Contains(err.Error(), "went away") {
		t.Errorf("with the host's end closed, the check said %v, not that the host went away", err)
	}
	if err := hostThere(1 << 20); err == nil || !strings.Contains(err.Error(), "not open") {
		t.Errorf("on a descriptor not open, the check said %v", err)
	}
}
