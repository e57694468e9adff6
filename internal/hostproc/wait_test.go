package hostproc

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

func threads(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatal("no Threads line")
	return 0
}

// Many waits hold no thread each, and each returns once its process has
// exited, not before.
func TestWaitPidfdManyWithoutThreads(t *testing.T) {
	const n = 200
	var cmds []*exec.Cmd
	var pidfds []int
	for range n {
		c := exec.Command("sleep", "2")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		fd, err := unix.PidfdOpen(c.Process.Pid, 0)
		if err != nil {
			t.Fatal(err)
		}
		cmds, pidfds = append(cmds, c), append(pidfds, fd)
	}
	before := threads(t)
	var wg sync.WaitGroup
	exitedFirst := make([]bool, n)
	for i, fd := range pidfds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			WaitPidfd(fd)
			// Exited (a zombie until Wait below), not still running.
			var info unix.Siginfo
			err := unix.Waitid(unix.P_PIDFD, fd, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
			exitedFirst[i] = err == nil && info.Signo != 0
		}()
	}
	// Every wait is parked well before sleep 2 ends. A wait in a thread of
	// its own holds n more threads; parked in the poller, a few (the
	// runtime starts some for the short system calls on the way).
	unix.Nanosleep(&unix.Timespec{Nsec: 500e6}, nil)
	if got := threads(t); got > before+n/2 {
		t.Errorf("%d waits hold %d more threads", n, got-before)
	}
	wg.Wait()
	for i, c := range cmds {
		if !exitedFirst[i] {
			t.Errorf("wait %d returned before its process exited", i)
		}
		_ = c.Wait()
		unix.Close(pidfds[i])
	}
}
