package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestSweepBinaries: the binaries' directories of exited test processes,
// and unnamed ones a day old, are removed; a live process's and a recent
// unnamed one are kept.
func TestSweepBinaries(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	exited := exec.Command("true")
	if err := exited.Run(); err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{ // name -> kept
		fmt.Sprintf("cage-bin-%d-1", exited.Process.Pid): false,
		fmt.Sprintf("cage-bin-%d-2", os.Getpid()):        true,
		"cage-bin-3": true,
		"cage-bin-4": false,
	}
	for name := range dirs {
		if err := os.MkdirAll(filepath.Join(tmp, name, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-25 * time.Hour)
	if err := os.Chtimes(filepath.Join(tmp, "cage-bin-4"), old, old); err != nil {
		t.Fatal(err)
	}
	sweepBinaries()
	for name, kept := range dirs {
		_, err := os.Stat(filepath.Join(tmp, name))
		if exists := err == nil; exists != kept {
			t.Errorf("%s: exists %v, want %v", name, exists, kept)
		}
	}
}

// FreeAddr never hands out a port twice, though the kernel may give a
// listen on :0 the port it gave the last one (closed since): a daemon
// given one port for its API and its proxy cannot start.
func TestFreeAddrDistinct(t *testing.T) {
	seen := map[string]bool{}
	for range 500 {
		a := FreeLoopback(t)
		if seen[a] {
			t.Fatalf("%s handed out twice", a)
		}
		seen[a] = true
	}
}
