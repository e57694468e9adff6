package state

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// TestRemoveStateStaysInside: a state directory holding what a teardown
// meets (a sandbox's disk tmpfs, a leftover bind of a host directory such
// as a template's layer, a file mount like a network namespace's, symlinks
// to the host's files and directories, one at a path mountinfo escapes) is
// removed with all of it, and nothing outside is touched: the host's files
// behind the links and the bound directory keep every file, and nothing
// stays mounted. (The removal before RemoveTree unmounted what mountinfo
// listed, by path, and then walked the tree with os.RemoveAll, which went
// into a mount it had failed to unmount, here the one whose path has a
// space, and deleted the host directory's files through it.)
func TestRemoveStateStaysInside(t *testing.T) {
	testutil.RequireRoot(t)
	runDir := testutil.RunDir(t)
	outside := t.TempDir()
	canary := filepath.Join(outside, "canary")
	if err := os.WriteFile(canary, []byte("host file"), 0o644); err != nil {
		t.Fatal(err)
	}
	hostDir := filepath.Join(outside, "layer")
	if err := os.MkdirAll(filepath.Join(hostDir, "usr"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostDir, "usr", "file"), []byte("layer file"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(runDir, "sandboxes", "0123456789abcdef0123")
	mk := func(p string) string {
		p = filepath.Join(dir, p)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	mount := func(src, dst, fstype string, flags uintptr) {
		if err := unix.Mount(src, dst, fstype, flags, ""); err != nil {
			t.Fatalf("mount %s: %v", dst, err)
		}
		t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
	}
	disk := mk("disk")
	mount("tmpfs", disk, "tmpfs", 0)
	if err := os.MkdirAll(filepath.Join(disk, "upper", "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"upper/etc/passwd": canary, "upper/host": outside, "upper/up": "../../../../.."} {
		if err := os.Symlink(target, filepath.Join(disk, name)); err != nil {
			t.Fatal(err)
		}
	}
	mount(hostDir, mk("lower/0"), "", unix.MS_BIND)
	mount(hostDir, mk("lower/1 2"), "", unix.MS_BIND)
	if err := os.WriteFile(filepath.Join(dir, "netns"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	mount(canary, filepath.Join(dir, "netns"), "", unix.MS_BIND)
	if err := os.Symlink(outside, filepath.Join(dir, "rootfs")); err != nil {
		t.Fatal(err)
	}

	if err := RemoveState(dir); err != nil {
		t.Errorf("RemoveState: %v", err)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("the state directory is still there: %v", err)
	}
	if b, err := os.ReadFile(canary); err != nil || string(b) != "host file" {
		t.Errorf("the host's file behind the links: %q, %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(hostDir, "usr", "file")); err != nil || string(b) != "layer file" {
		t.Errorf("the bound host directory lost its files: %q, %v", b, err)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), dir) {
		t.Errorf("mounts left under the state directory:\n%s", mounts)
	}
	if err := RemoveTree(filepath.Join(runDir, "nonexistent")); err != nil {
		t.Errorf("RemoveTree of nothing: %v", err)
	}
}
