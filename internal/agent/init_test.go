package agent

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestReserveThreads: the agent ends up holding at least the threads it
// asked for, reading its thread count once per batch of pins.
func TestReserveThreads(t *testing.T) {
	before := threadCount()
	if before == 0 {
		t.Skip("no /proc/self/status")
	}
	want := before + 6
	reserveThreads(want)
	if got := threadCount(); got < want {
		t.Fatalf("after reserveThreads(%d): %d threads (had %d)", want, got, before)
	}
	// Already enough: nothing more is started.
	n := threadCount()
	reserveThreads(n - 1)
	if got := threadCount(); got > n+1 {
		t.Errorf("reserveThreads(%d) with %d threads already: now %d", n-1, n, got)
	}
}

// TestAbsorbSignals: a process that has absorbed signals as PID 1 does
// survives every signal from 1 to 64 sent to it but KILL, STOP, 32 and 34,
// and a write to a broken standard error, which raises SIGPIPE. (Go leaves
// 32 and 34 at their default, which ends a process: the kernel drops them,
// as any signal without a handler, when sent to a namespace's init from
// inside it.)
// The process is this test binary again (TestAbsorbHelper), not a sandbox:
// in a sandbox the workload cannot signal the agent at all (another uid),
// so only the host could, and this is what the host would see.
func TestAbsorbSignals(t *testing.T) {
	if os.Getenv("CAGE_ABSORB_HELPER") != "" {
		t.Skip("this process is TestAbsorbSignals's helper")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAbsorbHelper$")
	cmd.Env = append(os.Environ(), "CAGE_ABSORB_HELPER=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderrR, stderrW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = stderrW
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stderrW.Close()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer cmd.Process.Kill()
	lines := bufio.NewReader(stdout)
	expect := func(want string) {
		t.Helper()
		got := make(chan string, 1)
		go func() { l, _ := lines.ReadString('\n'); got <- l }()
		select {
		case l := <-got:
			if strings.TrimSpace(l) != want {
				t.Fatalf("helper said %q, want %q", l, want)
			}
		case err := <-exited:
			t.Fatalf("the helper died: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatalf("no %q from the helper", want)
		}
	}
	expect("absorbing")
	for sig := syscall.Signal(1); sig <= 64; sig++ {
		if sig == syscall.SIGKILL || sig == syscall.SIGSTOP || sig == 32 || sig == 34 {
			continue
		}
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatalf("signal %d: %v (%v)", sig, err, <-exited)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := io.WriteString(stdin, "ping\n"); err != nil {
		t.Fatal(err)
	}
	expect("alive")
	// Its standard error broken: the next write there gets EPIPE.
	stderrR.Close()
	if _, err := io.WriteString(stdin, "stderr\n"); err != nil {
		t.Fatal(err)
	}
	expect("wrote")
	if _, err := io.WriteString(stdin, "ping\n"); err != nil {
		t.Fatal(err)
	}
	expect("alive")
}

// TestAbsorbHelper is TestAbsorbSignals's other process: it absorbs
// signals, then answers each line on its standard input.
func TestAbsorbHelper(t *testing.T) {
	if os.Getenv("CAGE_ABSORB_HELPER") == "" {
		t.Skip("run by TestAbsorbSignals")
	}
	absorbSignals()
	fmt.Println("absorbing")
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "ping":
			fmt.Println("alive")
		case "stderr":
			_, _ = fmt.Fprintln(os.Stderr, "to a pipe no one reads") // EPIPE
			fmt.Println("wrote")                                     // and still here
		}
	}
	os.Exit(0)
}
