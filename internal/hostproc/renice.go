package hostproc

import (
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// Foreground puts every thread of pid back to the normal priority. Nice
// is per thread in Linux: the threads of a process started niced each
// inherited the value, and a thread that a niced one makes while they are
// walked inherits it too without being in the walk's list, so the walk is
// repeated until a pass finds none left (at most 8 passes).
func Foreground(pid int) {
	for pass := 0; pass < 8 && foregroundOnce(pid) > 0; pass++ {
	}
}

// foregroundOnce renices pid's threads still niced and says how many.
func foregroundOnce(pid int) int {
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
