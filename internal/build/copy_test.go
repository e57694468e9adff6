package build

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/sandbox"
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
	go func() {
		done <- writeCopied(context.Background(), tar.NewWriter(io.Discard), root, files[0], 0, 0, io.Discard)
	}()
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
	err = writeCopied(ctx, tar.NewWriter(&n), root, files[0], 0, 0, io.Discard)
	if !errors.Is(err, context.Canceled) || n > 4096 {
		t.Errorf("a cancelled COPY of 1 MiB: %v, %d bytes written; want context.Canceled before the file's bytes", err, n)
	}
}

type countWriter int

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }

// Attack: the build context is someone else's (a user's checkout that
// root builds), and its owner rewrites a file between the moment a COPY
// reads it for its cache key and the moment it writes the layer. The
// layer then held the new bytes under the key of the old: every later
// build whose COPY reads the old bytes (another checkout, the operator's
// own) was served the owner's. Expected: the COPY fails with one line
// saying the context changed, nothing is cached, and a build of the old
// bytes gets the old bytes.
func TestCopyContextChangedWhileCopied(t *testing.T) {
	store, err := imgstore.Open(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	host := &sandbox.Host{Templates: store}
	bctx := t.TempDir()
	f := filepath.Join(bctx, "f")
	if err := os.WriteFile(f, []byte("good"), 0o644); err != nil {
		t.Fatal(err)
	}
	const dockerfile = "FROM scratch\nCOPY f /f\n"
	var out bytes.Buffer
	testHookBeforeCopy = func() {
		if err := os.WriteFile(f, []byte("evil"), 0o644); err != nil {
			t.Error(err)
		}
	}
	_, err = (&Builder{Host: host, Context: bctx, Out: &out}).Build(context.Background(), strings.NewReader(dockerfile), "swapped", "test")
	testHookBeforeCopy = nil
	if !errors.Is(err, ErrFailed) || !strings.Contains(err.Error(), "the build context changed while COPY read it") {
		t.Errorf("a COPY whose file changed after its key was made: %v; want it refused", err)
	}
	if err := os.WriteFile(f, []byte("good"), 0o644); err != nil {
		t.Fatal(err)
	}
	tm, err := (&Builder{Host: host, Context: bctx, Out: &out}).Build(context.Background(), strings.NewReader(dockerfile), "again", "test")
	if err != nil {
		t.Fatalf("build: %v\n%s", err, out.String())
	}
	dirs, err := store.LayerDirs(tm)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(dirs[len(dirs)-1], "f")); err != nil || string(got) != "good" {
		t.Errorf("a build of f holding %q: the layer's /f is %q, %v", "good", got, err)
	}
}
