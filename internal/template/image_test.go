package template

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOverlayByDescriptor: the overlay of two layers given as detached
// mounts (Linux 6.13+) merges them, the top one winning, and writes go to
// the upper directory; the fallback through attached paths does the same.
func TestOverlayByDescriptor(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root")
	}
	for _, how := range []string{"descriptors", "attached"} {
		t.Run(how, func(t *testing.T) {
			dir := t.TempDir()
			mk := func(p, content string) {
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			low, high := filepath.Join(dir, "low"), filepath.Join(dir, "high")
			mk(filepath.Join(low, "a"), "low")
			mk(filepath.Join(low, "b"), "low")
			mk(filepath.Join(high, "b"), "high")
			upper, work, root := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "root")
			for _, d := range []string{upper, work, root} {
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			var fds []int
			for _, l := range []string{low, high} {
				fd, err := unix.OpenTree(unix.AT_FDCWD, l, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(fd)
				fds = append(fds, fd)
			}
			var err error
			if how == "descriptors" {
				err = mountOverlayFDs(root, "cage-test", fds, upper, work)
				if errors.Is(err, unix.EINVAL) {
					t.Skip("SKIP: this kernel takes no overlay layers by descriptor (before 6.13)")
				}
			} else {
				err = mountOverlayAttached(root, "cage-test", filepath.Join(dir, "lower"), fds, upper, work)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Unmount(root, unix.MNT_DETACH)
			for name, want := range map[string]string{"a": "low", "b": "high"} {
				if b, err := os.ReadFile(filepath.Join(root, name)); err != nil || string(b) != want {
					t.Errorf("%s: %q, %v; want %q", name, b, err, want)
				}
			}
			mk(filepath.Join(root, "c"), "new")
			if b, err := os.ReadFile(filepath.Join(upper, "c")); err != nil || string(b) != "new" {
				t.Errorf("a write did not land in the upper layer: %q, %v", b, err)
			}
			if _, err := os.Stat(filepath.Join(dir, "lower")); !os.IsNotExist(err) {
				t.Errorf("the attached layers' directory is left: %v", err)
			}
		})
	}
}
