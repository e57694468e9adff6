package spawner

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// TestForkOwned: a process forked into a new user namespace through
// ForkOwned is in a namespace whose owner is the uid given, not root (the
// kernel charges the namespace's per-user counts to its owner), and is
// root inside it; no thread of this process is left with other ids.
func TestForkOwned(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	const owner = 1<<20 + 4095*65536 // a sandbox's range, far from real accounts
	attr := &syscall.ProcAttr{
		Files: []uintptr{0, 1, 2},
		Sys: &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: owner, Size: 65536}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: owner, Size: 65536}},
			Credential:  &syscall.Credential{Uid: 0, Gid: 0},
		},
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip(err)
	}
	pid, err := ForkOwned(owner, owner, func() (int, error) {
		return syscall.ForkExec(sleep, []string{"sleep", "30"}, attr)
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, 0, nil)
	}()
	ns, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "ns", "user"))
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var uid uint32
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, ns.Fd(), unix.NS_GET_OWNER_UID, uintptr(unsafe.Pointer(&uid))); e != 0 {
		t.Fatalf("NS_GET_OWNER_UID: %v", e)
	}
	if uid != owner {
		t.Errorf("the child's user namespace is owned by uid %d, want %d", uid, owner)
	}
	status, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), "Uid:\t"+strconv.Itoa(owner)+"\t"+strconv.Itoa(owner)+"\t"+strconv.Itoa(owner)) {
		t.Errorf("the child's ids: %s", lineOf(string(status), "Uid:"))
	}
	tasks, _ := filepath.Glob("/proc/self/task/*/status")
	for _, p := range tasks {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, k := range []string{"Uid:", "Gid:"} {
			if l := lineOf(string(b), k); l != k+"\t0\t0\t0\t0" {
				t.Errorf("%s: %q after the fork; want every id 0", p, l)
			}
		}
	}
	if _, err := ForkOwned(0, 0, func() (int, error) { t.Fatal("forked as root"); return 0, nil }); err == nil {
		t.Error("ForkOwned as uid 0: no error")
	}
}

func lineOf(s, key string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, key) {
			return l
		}
	}
	return ""
}
