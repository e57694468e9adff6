package oci

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPidfdClosedOnce: a sandbox's pidfd is closed once, whoever closes it
// second (a teardown after a checkpoint's stop) finds nothing to close. A
// second close of the number closed whatever file of the daemon had taken
// it since (found by review, 2026-12-04: the checkpoint and the teardown
// each closed it).
func TestPidfdClosedOnce(t *testing.T) {
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Skipf("pidfd_open: %v", err)
	}
	sb := &Sandbox{pidfd: fd}
	sb.closePidfd()
	// The next file opened takes the freed number.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if int(r.Fd()) != fd {
		t.Skipf("the pipe took %d, not the freed %d", r.Fd(), fd)
	}
	sb.closePidfd()
	if _, err := unix.FcntlInt(r.Fd(), unix.F_GETFD, 0); err != nil {
		t.Fatalf("the second close closed the file that took the number: %v", err)
	}
	if sb.pidfd != -1 {
		t.Errorf("pidfd %d after its close, want -1", sb.pidfd)
	}
}
