package procsys

import (
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestWriteInOwnNamespace: a write from a thread in a network namespace
// of its own sets that namespace's knob, as a write by path there would,
// and leaves the host's as it was.
func TestWriteInOwnNamespace(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root")
	}
	host, err := os.ReadFile("/proc/sys/net/core/optmem_max")
	if err != nil {
		t.Skipf("no net.core.optmem_max: %v", err)
	}
	got := make(chan string, 1)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends in its own namespace
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		if err := Write("net/core/optmem_max", "12345"); err != nil {
			errc <- err
			return
		}
		// By the path from this thread: /proc/sys/net shows the reading
		// thread's namespace.
		b, err := os.ReadFile("/proc/sys/net/core/optmem_max")
		if err != nil {
			errc <- err
			return
		}
		got <- string(b)
	}()
	select {
	case err := <-errc:
		t.Fatal(err)
	case v := <-got:
		if strings.TrimSpace(v) != "12345" {
			t.Errorf("the namespace's optmem_max after the write: %q, want 12345", v)
		}
	}
	if now, _ := os.ReadFile("/proc/sys/net/core/optmem_max"); string(now) != string(host) {
		t.Errorf("the host's optmem_max went from %q to %q", host, now)
	}
	if fd, err := ownProc(); err != nil {
		t.Logf("no procfs of its own here (%v): the write went by path", err)
	} else {
		unix.Close(fd)
	}
}
