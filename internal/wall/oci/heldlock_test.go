package oci

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall/state"
)

// TestGVisorHeldLock: root inside gVisor, with the capabilities the agent
// starts with, given the slot's lock file as the agent is (--pass-fd),
// changes nothing of the host's file: not its mode, owner, size, content
// or times (ctime, which any change moves), and reaches nothing beside it.
// gVisor's sentry, root of a user namespace mapping every host id, with
// CAP_FOWNER, did set the host file's times for it (futimens) before the
// file was made immutable (state.IDRange).
func TestGVisorHeldLock(t *testing.T) {
	testutil.RequireRoot(t)
	runsc := os.Getenv("CAGE_RUNSC")
	if runsc == "" {
		runsc, _ = exec.LookPath("runsc")
	}
	if _, err := os.Stat(runsc); runsc == "" || err != nil {
		testutil.SkipWall(t, "gvisor", "no runsc (set CAGE_RUNSC)")
	}
	dir := t.TempDir()
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"proc", "dev", "tmp"} {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	build := exec.Command("go", "build", "-o", filepath.Join(rootfs, "probe"), "./internal/wall/oci/testdata/heldprobe")
	build.Dir, build.Env = testutil.RepoRoot(), append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the probe: %v\n%s", err, out)
	}
	old := state.IDLockDir
	state.IDLockDir = filepath.Join(dir, "ids")
	defer func() { state.IDLockDir = old }()
	ids, err := state.ReserveIDs()
	if err != nil {
		t.Fatal(err)
	}
	defer ids.Release()
	var before unix.Stat_t
	if err := unix.Stat(ids.Held.Name(), &before); err != nil {
		t.Fatal(err)
	}

	caps := `["` + strings.Join(containerCaps, `","`) + `"]`
	config := `{"ociVersion": "1.0.2",
 "process": {"user": {"uid": 0, "gid": 0}, "args": ["/probe", "3"], "cwd": "/", "env": ["PATH=/"],
  "capabilities": {"bounding": ` + caps + `, "effective": ` + caps + `, "permitted": ` + caps + `}},
 "root": {"path": "rootfs"},
 "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
  {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}, {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
 "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]}}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "runsc")
	defer func() {
		_ = exec.Command(runsc, "--root", root, "delete", "--force", "held").Run()
		_ = unix.Unmount(filepath.Join(root, "null-netns"), unix.MNT_DETACH) // runsc's --network=none namespace
	}()
	args := append(append([]string{}, gvisorFlags...), "--root", root, "run", "--bundle", dir, "--pass-fd", "3:3", "held")
	cmd := exec.Command(runsc, args...)
	cmd.ExtraFiles = []*os.File{ids.Held}
	out, err := cmd.CombinedOutput()
	t.Logf("inside gVisor:\n%s", out)
	if err != nil || !strings.Contains(string(out), "done") {
		t.Fatalf("runsc run: %v", err)
	}

	var after unix.Stat_t
	if err := unix.Stat(ids.Held.Name(), &after); err != nil {
		t.Fatal(err)
	}
	if after.Mode != before.Mode || after.Uid != before.Uid || after.Gid != before.Gid || after.Size != before.Size {
		t.Errorf("the host's lock file: mode %o uid %d gid %d size %d, was %o %d %d %d",
			after.Mode, after.Uid, after.Gid, after.Size, before.Mode, before.Uid, before.Gid, before.Size)
	}
	if after.Mtim != before.Mtim || after.Ctim != before.Ctim {
		t.Errorf("the host's lock file's times changed: mtime %v ctime %v, were %v %v",
			after.Mtim, after.Ctim, before.Mtim, before.Ctim)
	}
	if ents, _ := os.ReadDir(state.IDLockDir); len(ents) != 2 {
		t.Errorf("%d files in the lock directory, want the slot's 2", len(ents))
	}
}
