package bench

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// The CPU split of the create windows reads /proc: a process's own CPU, a
// child found by its name under whichever thread forked it, and a command
// name with spaces and parentheses in it.
func TestProcCPU(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	before, host := procCPU(os.Getpid()), hostBusy()
	if host <= 0 {
		t.Fatalf("hostBusy = %v, want the host's busy time since boot", host)
	}
	deadline := time.Now().Add(300 * time.Millisecond)
	for n := 0; time.Now().Before(deadline); n++ {
		_ = strconv.Itoa(n)
	}
	if got := procCPU(os.Getpid()) - before; got < 100*time.Millisecond {
		t.Errorf("300 ms of spinning counted as %v of this process's CPU", got)
	}
	if got := hostBusy() - host; got < 100*time.Millisecond {
		t.Errorf("300 ms of spinning counted as %v of the host's busy time", got)
	}
	if procCPU(0) != 0 || procCPU(1<<30) != 0 {
		t.Error("procCPU of no process is not 0")
	}

	dir := t.TempDir()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep(1)")
	}
	b, err := os.ReadFile(sleep)
	if err != nil {
		t.Fatal(err)
	}
	start := func(name string) *exec.Cmd {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o755); err != nil {
			t.Fatal(err)
		}
		c := exec.Command(p, "30")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Kill(); _ = c.Wait() })
		return c
	}
	if got := spawnerOf(os.Getpid()); got != 0 {
		t.Fatalf("spawnerOf found %d before any cage-agent child started", got)
	}
	odd := start("a (b) c")
	if f := procStat(odd.Process.Pid); len(f) < 15 || f[1] != "a (b) c" || f[0] != strconv.Itoa(odd.Process.Pid) {
		t.Fatalf("procStat of %q = %q", "a (b) c", f)
	}
	agent := start("cage-agent")
	if got := spawnerOf(os.Getpid()); got != agent.Process.Pid {
		t.Errorf("spawnerOf = %d, want the cage-agent child %d", got, agent.Process.Pid)
	}
}
