package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestWriteTarSwappedUnderIt: `cage cp` and `cage run --copy-in` read, as
// root, a directory another host user may change meanwhile. That user
// swaps a subdirectory for a link to a directory of root's, and a file
// for a FIFO, over and over while the copies run: no copy carries a byte
// from outside the directory, and none blocks. Found by review,
// 2026-12-03: the walk lstat'ed "sub" as a directory and then read it by
// path, following the link swapped in.
func TestWriteTarSwappedUnderIt(t *testing.T) {
	src, outside := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("ROOT-SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	sub, subDir, subLink := filepath.Join(src, "sub"), filepath.Join(src, ".sub-dir"), filepath.Join(src, ".sub-link")
	if err := os.Mkdir(subDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(subDir, "f"), []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, subLink); err != nil {
		t.Fatal(err)
	}
	file, fifo := filepath.Join(src, "file"), filepath.Join(src, ".fifo")
	if err := os.WriteFile(file, []byte("mine"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	done := make(chan struct{})
	go func() { // the other user: swaps by rename, as fast as it can
		defer close(done)
		for i := 0; !stop.Load(); i++ {
			_ = os.Rename(subDir, sub) // sub: a directory
			_ = os.Rename(sub, subDir)
			_ = os.Rename(subLink, sub) // sub: a link out
			_ = os.Rename(sub, subLink)
			if i%2 == 0 {
				_ = syscall.Mkfifo(fifo, 0o644)
			} else {
				_ = os.WriteFile(fifo, []byte("mine"), 0o644)
			}
			_ = os.Rename(fifo, file)
		}
	}()
	defer func() { stop.Store(true); <-done }()
	leaks := 0
	deadline := time.Now().Add(10 * time.Second)
	for n := 0; n < 2000 && time.Now().Before(deadline); n++ {
		var buf bytes.Buffer
		ch := make(chan error, 1)
		go func() { ch <- writeTar(&buf, src) }()
		select {
		case <-ch:
		case <-time.After(5 * time.Second):
			t.Fatal("a copy blocked (a FIFO swapped in for a file was opened)")
		}
		tr := tar.NewReader(&buf)
		for {
			_, err := tr.Next()
			if err != nil {
				break
			}
			b, _ := io.ReadAll(tr)
			if bytes.Contains(b, []byte("ROOT-SECRET")) {
				leaks++
			}
		}
		if bytes.Contains(buf.Bytes(), []byte("ROOT-SECRET")) && leaks == 0 {
			leaks++
		}
	}
	if leaks > 0 {
		t.Fatalf("%d copies carried a file from outside the directory", leaks)
	}
}

// TestCopyToSandboxNotRegular: `cage cp FILE ID:PATH` reads, as root, a
// file another host user may have made a FIFO (or swapped for one after
// cage looked at it) or a device: each is refused at once, with its type,
// and nothing is sent (before, the FIFO's open blocked the copy for good
// and /dev/zero was sent without end).
func TestCopyToSandboxNotRegular(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{fifo, "/dev/zero"} {
		done := make(chan error, 1)
		go func() { done <- copyToSandbox(context.Background(), nil, "user", src, "/tmp/x") }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), "not a regular file") {
				t.Errorf("%s: got %v, want it refused as not a regular file", src, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the copy still blocks after 5 s", src)
		}
	}
}
