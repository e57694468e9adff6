// Package testutil holds the helpers every integration test shares: skips
// that probe the host for a feature (never the kernel version) and say why,
// and building cage's binaries once per test process.
package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
)

// RequireRoot skips a test that needs root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root (run the suite with sudo, as CI does)")
	}
}

// Feature is a kernel feature a test can require.
type Feature string

const (
	UserNamespaces Feature = "user namespaces"
	MountAPI       Feature = "open_tree/mount_setattr"
	Landlock       Feature = "landlock"
	Cgroups        Feature = "cgroups"
)

// RequireKernelFeature skips a test when the host lacks f, printing why.
func RequireKernelFeature(t testing.TB, f Feature) {
	t.Helper()
	if why := probe(f); why != "" {
		t.Skipf("SKIP: needs %s: %s", f, why)
	}
}

func probe(f Feature) string {
	switch f {
	case UserNamespaces:
		if _, err := os.Stat("/proc/self/ns/user"); err != nil {
			return "the kernel has no user namespaces"
		}
	case MountAPI:
		fd, err := unix.OpenTree(unix.AT_FDCWD, "/", unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return "open_tree: " + err.Error()
		}
		unix.Close(fd)
	case Landlock:
		if _, _, e := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION); e != 0 {
			return "landlock_create_ruleset: " + e.Error()
		}
	case Cgroups:
		b, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil || !strings.Contains(string(b), " - cgroup") {
			return "no cgroup filesystem mounted"
		}
	}
	return ""
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// Binaries builds bin/cage and bin/cage-agent (static, as `make` does) once
// per test process and returns the directory holding them. The directory
// is named after the process (a test binary has no hook at its exit to
// remove it): each build first removes those of processes that are gone,
// so that runs of the suite do not fill the disk (78 MB each).
func Binaries(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		sweepBinaries()
		buildDir, buildErr = os.MkdirTemp("", fmt.Sprintf("cage-bin-%d-", os.Getpid()))
		if buildErr != nil {
			return
		}
		// Readable by the unprivileged users tests run cage as.
		_ = os.Chmod(buildDir, 0o755)
		root := RepoRoot()
		for _, name := range []string{"cage", "cage-agent"} {
			cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(buildDir, name), "./cmd/"+name)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %v\n%s", name, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// sweepBinaries removes the binaries' directories of test processes that
// have exited (and unnamed ones, of older test code, a day old).
func sweepBinaries() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "cage-bin-*"))
	for _, dir := range dirs {
		pidStr, _, named := strings.Cut(strings.TrimPrefix(filepath.Base(dir), "cage-bin-"), "-")
		pid, err := strconv.Atoi(pidStr)
		if !named || err != nil || pid <= 0 {
			if fi, err := os.Stat(dir); err == nil && time.Since(fi.ModTime()) > 24*time.Hour {
				_ = os.RemoveAll(dir)
			}
			continue
		}
		if unix.Kill(pid, 0) == unix.ESRCH {
			_ = os.RemoveAll(dir)
		}
	}
}

// RepoRoot is the repository's top directory.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// KernelDir is where the microvm wall's guest kernel is for tests:
// $CAGE_KERNEL_DIR, else the repository's .tools/kernel, where
// scripts/kernel.sh puts it.
func KernelDir() string {
	if dir := os.Getenv("CAGE_KERNEL_DIR"); dir != "" {
		return dir
	}
	return filepath.Join(RepoRoot(), ".tools", "kernel")
}

// RunDir makes a runtime directory for a test's sandboxes that the
// sandboxes' own root users can traverse (t.TempDir's parents are 0700).
func RunDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/run", "cage-test-")
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(dir, 0o711)
	t.Cleanup(func() { RemoveRunDir(dir) })
	return dir
}

// RemoveRunDir unmounts what cage mounted under dir (template caches) and
// removes it.
func RemoveRunDir(dir string) {
	// A daemon a test stopped leaves its sandboxes running (for a restart
	// to adopt): their processes and cgroups go with the directory, or
	// they would run on with nothing left to end them.
	if ents, err := os.ReadDir(filepath.Join(dir, "sandboxes")); err == nil && len(ents) > 0 {
		if m, err := cgroups.Detect("cage"); err == nil {
			for _, e := range ents {
				_ = m.Open(e.Name()).Destroy()
			}
		}
	}
	data, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			_ = unix.Unmount(f[4], unix.MNT_DETACH)
		}
	}
	os.RemoveAll(dir)
}

// SkipWall skips a test of a wall this host lacks, saying why; where the
// wall is required (CAGE_REQUIRE_WALLS, which `make test` sets as root to
// every wall) it fails instead, so a missing runtime never passes as green.
func SkipWall(t testing.TB, wall, format string, args ...any) {
	t.Helper()
	why := fmt.Sprintf(format, args...)
	if WallRequired(wall) {
		t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but: %s", wall, why)
	}
	t.Skipf("SKIP wall %s: %s", wall, why)
}

// WallRequired reports whether CAGE_REQUIRE_WALLS names wall.
func WallRequired(wall string) bool {
	return strings.Contains(","+os.Getenv("CAGE_REQUIRE_WALLS")+",", ","+wall+",")
}
