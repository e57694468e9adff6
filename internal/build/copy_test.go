package build

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Attack: a build context (a repository someone else wrote) names a FIFO
// as a COPY source, or puts one in a listed file's place before it is
// read. The host opened it and waited for a writer that never comes.
// Expected: a FIFO named as a source is refused with a line that says
// so; a file turned FIFO after it was listed is refused at once.
func TestCopyNeverOpensAFIFO(t *testing.T) {
	dir := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(dir, "p"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	if files, err := collect(root, "p", "/x", false); err == nil || !strings.Contains(err.Error(), "not a file, directory or symbolic link") {
		t.Errorf("COPY p (a FIFO): %+v, %v; want refused", files, err)
	}
	files, err := collect(root, "f", "/x", false)
	if err != nil || len(files) != 1 {
		t.Fatalf("COPY f: %+v, %v", files, err)
	}
	if err := os.Remove(filepath.Join(dir, "f")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(dir, "f"), 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- writeCopied(context.Background(), tar.NewWriter(io.Discard), root, files[0], 0, 0) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("copying a file turned FIFO: %v; want refused", err)
		}
	case <-time.After(time.Minute):
		t.Error("copying a file turned FIFO waited on it")
		if w, err := os.OpenFile(filepath.Join(dir, "f"), os.O_WRONLY, 0); err == nil {
			w.Close()
		}
	}
}

// A COPY stops reading when its build is cancelled (an interrupt of cage
// template build, which no longer dies at once but cleans up): a large
// file is not read to its end first.
func TestCopyStopsWhenCancelled(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "big"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	files, err := collect(root, "big", "/big", false)
	if err != nil || len(files) != 1 {
		t.Fatalf("COPY big: %+v, %v", files, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var n countWriter
	err = writeCopied(ctx, tar.NewWriter(&n), root, files[0], 0, 0)
	if !errors.Is(err, context.Canceled) || n > 4096 {
		t.Errorf("a cancelled COPY of 1 MiB: %v, %d bytes written; want context.Canceled before the file's bytes", err, n)
	}
}

type countWriter int

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }
