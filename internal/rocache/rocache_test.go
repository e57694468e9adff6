package rocache

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestExecutable: a program's copy is read-only, on a tmpfs of its own
// backed by huge pages where the kernel allows them, reused while the
// program is unchanged and made anew when it is replaced.
func TestExecutable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounts tmpfs: needs root")
	}
	dir, src := t.TempDir(), filepath.Join(t.TempDir(), "prog")
	if err := os.WriteFile(src, []byte("#!/bin/sh\necho one\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			Remove(filepath.Join(dir, e.Name()))
		}
	})
	first, err := Executable(dir, src, "cage-agent")
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(first) != "cage-agent" {
		t.Errorf("copy named %s, want cage-agent", first)
	}
	if b, err := os.ReadFile(first); err != nil || !bytes.Equal(b, []byte("#!/bin/sh\necho one\n")) {
		t.Fatalf("copy holds %q (%v)", b, err)
	}
	if err := os.WriteFile(first, []byte("x"), 0o755); err == nil {
		t.Error("the copy is writable")
	}
	opts := mountOptions(t, filepath.Dir(first))
	if !strings.HasPrefix(opts, "ro,") {
		t.Errorf("copy's mount options %q: not read-only", opts)
	}
	if thp, _ := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled"); len(thp) > 0 && !bytes.Contains(thp, []byte("[deny]")) {
		if !strings.Contains(opts, "huge=within_size") {
			t.Errorf("copy's mount options %q: no huge pages, though the kernel has them (%s)", opts, bytes.TrimSpace(thp))
		}
	}
	again, err := Executable(dir, src, "cage-agent")
	if err != nil || again != first {
		t.Errorf("unchanged program: copy %s (%v), want the same %s", again, err, first)
	}
	// Replaced (a new inode, as an install does): a copy of its own.
	repl := src + ".new"
	if err := os.WriteFile(repl, []byte("#!/bin/sh\necho two\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(repl, src); err != nil {
		t.Fatal(err)
	}
	second, err := Executable(dir, src, "cage-agent")
	if err != nil {
		t.Fatal(err)
	}
	if second == first {
		t.Fatalf("replaced program: same copy %s", second)
	}
	if b, _ := os.ReadFile(second); !bytes.Equal(b, []byte("#!/bin/sh\necho two\n")) {
		t.Errorf("new copy holds %q", b)
	}
	if b, _ := os.ReadFile(first); !bytes.Equal(b, []byte("#!/bin/sh\necho one\n")) {
		t.Errorf("the old copy (a running sandbox's) changed: %q", b)
	}
}

// mountOptions returns the mount and superblock options of the mount at dir.
func mountOptions(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 5 && f[4] == dir {
			return f[5] + " " + f[len(f)-1]
		}
	}
	t.Fatalf("%s is not a mount point", dir)
	return ""
}
