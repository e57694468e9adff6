package hostproc

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// nices reads the nice value of each of pid's threads.
func nices(pid int) map[int]int {
	out := map[int]int{}
	tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if p, err := unix.Getpriority(unix.PRIO_PROCESS, tid); err == nil {
			out[tid] = 20 - p
		}
	}
	return out
}

// TestForeground: a process whose threads were all made niced (its main
// thread niced before it made them) has every thread back at 0 after
// Foreground.
func TestForeground(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: lowering a nice value needs root")
	}
	// The helper makes its threads only once told to, so its main
	// thread is niced before any other thread exists.
	cmd := exec.Command("python3", "-c", "import threading, sys, time\n"+
		"sys.stdin.readline()\n"+
		"ts = [threading.Thread(target=time.sleep, args=(30,), daemon=True) for _ in range(4)]\n"+
		"[t.start() for t in ts]\nprint('up', flush=True)\ntime.sleep(30)\n")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Skipf("SKIP: python3: %v", err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	pid := cmd.Process.Pid
	if err := unix.Setpriority(unix.PRIO_PROCESS, pid, 15); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	// A pipe may hand the line over in pieces: read up to its end.
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "up\n" {
		t.Fatalf("the helper did not start its threads: %q %v", line, err)
	}
	before := nices(pid)
	if len(before) < 5 {
		t.Fatalf("the helper has %d threads, want 5", len(before))
	}
	for tid, n := range before {
		if n != 15 {
			t.Fatalf("thread %d starts at nice %d, want 15 (inherited)", tid, n)
		}
	}
	start := time.Now()
	Foreground(pid)
	for tid, n := range nices(pid) {
		if n != 0 {
			t.Errorf("thread %d is at nice %d after Foreground (%v)", tid, n, time.Since(start))
		}
	}
}
