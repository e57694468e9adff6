package build

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// captureGuarded runs capture on dir and fails the test if it has not
// returned within a minute (a guard against a hang, not a measure of speed).
func captureGuarded(t *testing.T, dir string) (int, error) {
	t.Helper()
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	type res struct {
		n   int
		err error
	}
	done := make(chan res, 1)
	go func() {
		n, err := capture(context.Background(), root, 0, 1<<30, filepath.Join(t.TempDir(), "layer.tar"))
		done <- res{n, err}
	}()
	select {
	case r := <-done:
		return r.n, r.err
	case <-time.After(time.Minute):
		t.Fatalf("capture hung")
		return 0, nil
	}
}

// TestCaptureBounds: a step's tree past a layer's bounds is refused as the
// walk meets it, with a line that says which bound, before the host has
// paid for the rest of it: a chain of directories deeper than 256, and a
// name longer than 4096 bytes made of long directory names; a tree inside
// them is captured whole; a cancelled build stops its capture.
func TestCaptureBounds(t *testing.T) {
	// mkChain makes depth nested directories named name, and a file at the
	// bottom, one level at a time from a descriptor of the last (a path
	// may be longer than one system call takes).
	mkChain := func(t *testing.T, depth int, name string) string {
		dir := t.TempDir()
		fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		for range depth {
			if err := unix.Mkdirat(fd, name, 0o755); err != nil {
				t.Fatal(err)
			}
			next, err := unix.Openat(fd, name, unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			unix.Close(fd)
			if err != nil {
				t.Fatal(err)
			}
			fd = next
		}
		f, err := unix.Openat(fd, "f", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		unix.Close(fd)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(f)
		return dir
	}
	if _, err := captureGuarded(t, mkChain(t, 300, "d")); !errors.Is(err, errCaptureBounds) || !strings.Contains(err.Error(), "directories deep") {
		t.Errorf("a chain 300 deep: %v; want refused for its depth", err)
	}
	if _, err := captureGuarded(t, mkChain(t, 20, strings.Repeat("n", 250))); !errors.Is(err, errCaptureBounds) || !strings.Contains(err.Error(), "a name of") {
		t.Errorf("a path of 20 names of 250 bytes: %v; want refused for its length", err)
	}
	if n, err := captureGuarded(t, mkChain(t, 200, "d")); err != nil || n != 201 {
		t.Errorf("a chain 200 deep: %d entries, %v; want all 201 captured", n, err)
	}
	root, err := os.OpenRoot(mkChain(t, 3, "d"))
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := capture(ctx, root, 0, 1<<30, filepath.Join(t.TempDir(), "layer.tar")); !errors.Is(err, context.Canceled) {
		t.Errorf("a cancelled capture: %v; want context.Canceled", err)
	}
}

// Attack: a RUN step makes a sparse file of a terabyte (truncate -s 1T),
// which takes none of its disk; the capture wrote its every byte, zeros,
// into the layer tar in the host's temporary directory, until that (a
// tmpfs: the host's memory) was full. Expected: the capture is refused as
// soon as the files' bytes pass the step's disk, having written no more;
// files within it are captured.
func TestCaptureSparseFileBounded(t *testing.T) {
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(1 << 40); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.WriteFile(filepath.Join(dir, "small"), bytes.Repeat([]byte("x"), 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	out := filepath.Join(t.TempDir(), "layer.tar")
	_, err = capture(context.Background(), root, 0, 64<<20, out)
	if !errors.Is(err, errCaptureBounds) || !strings.Contains(err.Error(), "more bytes than the step's disk") {
		t.Errorf("a sparse file of 1 TiB with a disk of 64 MiB: %v; want refused", err)
	}
	if fi, err := os.Stat(out); err == nil && fi.Size() > 64<<20 {
		t.Errorf("the layer tar grew to %d bytes", fi.Size())
	}
	if err := os.Remove(filepath.Join(dir, "huge")); err != nil {
		t.Fatal(err)
	}
	if n, err := capture(context.Background(), root, 0, 64<<20, out); err != nil || n != 1 {
		t.Errorf("a 4 KiB file with a disk of 64 MiB: %d entries, %v; want it captured", n, err)
	}
}

// TestCaptureSwappedForFIFO: the sandbox swaps a file, or a directory, for
// a FIFO between the capture's Lstat and its open. The capture refuses the
// entry at once; it never waits on the FIFO for a writer that never comes.
func TestCaptureSwappedForFIFO(t *testing.T) {
	for _, kind := range []string{"file", "dir"} {
		t.Run(kind, func(t *testing.T) {
			dir := t.TempDir()
			victim := filepath.Join(dir, "victim")
			if kind == "file" {
				if err := os.WriteFile(victim, []byte("data"), 0o644); err != nil {
					t.Fatal(err)
				}
			} else if err := os.Mkdir(victim, 0o755); err != nil {
				t.Fatal(err)
			}
			testHookAfterLstat = func(p string) {
				if p != "victim" {
					return
				}
				fifo := filepath.Join(dir, ".fifo")
				if err := syscall.Mkfifo(fifo, 0o644); err != nil {
					t.Error(err)
				}
				os.RemoveAll(victim)
				if err := os.Rename(fifo, victim); err != nil {
					t.Error(err)
				}
			}
			defer func() { testHookAfterLstat = nil }()
			_, err := captureGuarded(t, dir)
			if err == nil || !strings.Contains(err.Error(), "victim changed while it was read") {
				t.Errorf("capture of a %s swapped for a FIFO: %v; want it refused", kind, err)
			}
		})
	}
}

// TestCaptureSwappedFile: a file swapped for another file is refused too
// (what was read would not be the file whose owner and mode the header
// says).
func TestCaptureSwappedFile(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"victim", ".other"} {
		if err := os.WriteFile(filepath.Join(dir, n), []byte(n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	testHookAfterLstat = func(p string) {
		if p == "victim" {
			os.Rename(filepath.Join(dir, ".other"), filepath.Join(dir, "victim"))
		}
	}
	defer func() { testHookAfterLstat = nil }()
	if _, err := captureGuarded(t, dir); err == nil || !strings.Contains(err.Error(), "changed while it was read") {
		t.Errorf("capture of a swapped file: %v; want it refused", err)
	}
}

// TestBuildStepLeavesFIFOSwapper: a RUN step leaves a process behind that
// keeps swapping its files for FIFOs and back. The step's layer is read
// only once that process is gone (its sandbox destroyed), so the build
// neither hangs nor fails, and the layer holds the files as they were left.
// A context deadline guards against a hang; it measures nothing.
func TestBuildStepLeavesFIFOSwapper(t *testing.T) {
	host, ctx := buildHost(t)
	// Files 250 directories deep (a long walk from the layer's top to each,
	// which widens the window between a reader's Lstat and its open; a
	// layer holds paths at most 256 deep, see TestCaptureBounds), and
	// four processes left behind swapping s1..s4 for FIFOs and back,
	// atomically (rename), as fast as they can. k1..k4 stay as they are.
	// (cage's builder expands $NAME in RUN as Docker's does not: \$ keeps
	// the shell's variables.)
	const dockerfile = `FROM bb
RUN mkdir /w && cd /w && for i in $(busybox seq 250); do mkdir d && cd d; done && \
    for i in 1 2 3 4; do echo x > s\$i; echo k > k\$i; done && \
    for j in 1 2 3 4; do (while :; do busybox mkfifo .p\$j && mv -f .p\$j s\$j; echo y > .r\$j && mv -f .r\$j s\$j; done) </dev/null >/dev/null 2>&1 & done; \
    echo > /done
`
	var out bytes.Buffer
	b := &Builder{Host: host, Context: t.TempDir(), Out: &out}
	tm, err := b.Build(ctx, strings.NewReader(dockerfile), "swapped", "test")
	if err != nil {
		t.Fatalf("build: %v\n%s", err, out.String())
	}
	dirs, err := host.Templates.LayerDirs(tm)
	if err != nil {
		t.Fatal(err)
	}
	top := dirs[len(dirs)-1]
	if _, err := os.Lstat(filepath.Join(top, "done")); err != nil {
		t.Errorf("the step's layer lacks /done: %v", err)
	}
	// The files left alone are there; the swapped ones are files or absent
	// (FIFOs are not carried), never FIFOs.
	deep := filepath.Join(append([]string{top, "w"}, strings.Split(strings.Repeat("d/", 250), "/")...)...)
	ents, err := os.ReadDir(deep)
	if err != nil {
		t.Fatal(err)
	}
	kept := 0
	for _, e := range ents {
		switch {
		case e.Type()&os.ModeNamedPipe != 0:
			t.Errorf("%s: a FIFO in the layer", e.Name())
		case strings.HasPrefix(e.Name(), "k") && e.Type().IsRegular():
			kept++
		}
	}
	if kept != 4 {
		t.Errorf("the layer's deepest directory holds %v; want k1..k4 among them", ents)
	}
	checkLayerTar(t, host.Templates, tm)
}

// checkLayerTar exports the template and reads every entry of its layers.
func checkLayerTar(t *testing.T, s *imgstore.Store, tm *imgstore.Template) {
	t.Helper()
	var buf bytes.Buffer
	if err := s.Export(context.Background(), tm.Name, &buf); err != nil {
		t.Fatalf("export: %v", err)
	}
	tr := tar.NewReader(&buf)
	for {
		_, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatalf("export: %v", err)
		}
	}
}

// A build's layers are staged in the template store, never in the host's
// $TMPDIR (often a tmpfs: a RUN step's changes, as large as its disk,
// would be held in the host's memory). With $TMPDIR missing, a build
// with a COPY and a RUN step still succeeds.
func TestBuildLayersNotInTmpdir(t *testing.T) {
	host, ctx := buildHost(t)
	bctx := t.TempDir()
	if err := os.WriteFile(filepath.Join(bctx, "in"), []byte("copied\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", filepath.Join(t.TempDir(), "missing"))
	var out bytes.Buffer
	b := &Builder{Host: host, Context: bctx, Out: &out}
	tm, err := b.Build(ctx, strings.NewReader("FROM bb\nCOPY in /in\nRUN echo ran > /ran\n"), "staged", "test")
	if err != nil {
		t.Fatalf("build with $TMPDIR missing: %v\n%s", err, out.String())
	}
	dirs, err := host.Templates.LayerDirs(tm)
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) < 3 {
		t.Fatalf("layers %q; want the base's, COPY's and RUN's", dirs)
	}
	for _, c := range []struct{ dir, file, want string }{{dirs[len(dirs)-2], "in", "copied\n"}, {dirs[len(dirs)-1], "ran", "ran\n"}} {
		if got, err := os.ReadFile(filepath.Join(c.dir, c.file)); err != nil || string(got) != c.want {
			t.Errorf("layer's /%s: %q, %v; want %q", c.file, got, err, c.want)
		}
	}
	left, _ := filepath.Glob(filepath.Join(host.Templates.Dir(), "layers", ".tmp-*"))
	if len(left) != 0 {
		t.Errorf("staging files left in the store: %q", left)
	}
}

// buildHost is a host with a template store holding the test image as
// "bb", and a context that guards the test against a hang (3 minutes).
func buildHost(t *testing.T) (*sandbox.Host, context.Context) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	host, err := sandbox.NewHost(testutil.RunDir(t), filepath.Join(testutil.Binaries(t), "cage-agent"), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { host.Close() })
	if host.Templates, err = imgstore.Open(filepath.Join(t.TempDir(), "templates")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	if _, err := host.Templates.Import(ctx, testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest"), "bb", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	return host, ctx
}
