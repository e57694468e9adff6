package spawner

import (
	"errors"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// describeChild is what a child started into new namespaces says of
// itself: ids, id maps, pid, session, cwd, signal state, descriptors.
const describeChild = `echo "uid $(id -u) gid $(id -g) groups $(id -G) pid $$"
cat /proc/self/uid_map /proc/self/gid_map /proc/self/setgroups
read -r pid _ _ _ _ sid _ < /proc/self/stat; [ "$pid" = "$sid" ] && echo "session leader"
echo "cwd $(pwd)"
grep -E '^(SigBlk|SigIgn|CapEff|NoNewPrivs)' /proc/self/status
ls /proc/self/fd | sort -n | tr '\n' ' '; echo
echo to-fd-3 >&3
`

// startDescribed starts describeChild with start and returns what it
// printed and what it wrote on its fourth descriptor.
func startDescribed(t *testing.T, start func(string, []string, *syscall.ProcAttr) (int, error), flags uintptr) (string, string) {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer outR.Close()
	extraR, extraW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer extraR.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	const base = 1<<20 + 4094*65536
	attr := &syscall.ProcAttr{
		Dir:   "/",
		Env:   []string{"PATH=/usr/bin:/bin"},
		Files: []uintptr{devnull.Fd(), outW.Fd(), outW.Fd(), extraW.Fd()},
		Sys: &syscall.SysProcAttr{
			Cloneflags:                 flags,
			UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}},
			GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}},
			GidMappingsEnableSetgroups: true,
			Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
			Setsid:                     true,
			Pdeathsig:                  syscall.SIGKILL,
		},
	}
	runtime.LockOSThread() // the parent-death signal follows the thread
	defer runtime.UnlockOSThread()
	pid, err := start(sh, []string{"sh", "-c", describeChild}, attr)
	outW.Close()
	extraW.Close()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(outR)
	extra, _ := io.ReadAll(extraR)
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil || ws.ExitStatus() != 0 {
		t.Errorf("child: %v, %v\n%s", ws, err, out)
	}
	return string(out), string(extra)
}

// TestCloneExec: a child CloneExec starts is the child syscall.ForkExec
// starts from the same attributes: root of its new user namespace with
// the maps asked for, pid 1 of its pid namespace, leader of its own
// session, in the directory asked for, no signal blocked, what the caller
// ignores still ignored and every other at its default, exactly the
// descriptors asked for (ls's own is the last).
func TestCloneExec(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	signal.Ignore(syscall.SIGUSR2) // ignored here, so in the children (as CI's shell may ignore others)
	defer signal.Reset(syscall.SIGUSR2)
	flags := uintptr(syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWIPC |
		syscall.CLONE_NEWUTS | syscall.CLONE_NEWNET)
	got, gotExtra := startDescribed(t, CloneExec, flags)
	want, wantExtra := startDescribed(t, syscall.ForkExec, flags)
	t.Logf("CloneExec's child:\n%s", got)
	if got != want || gotExtra != wantExtra {
		t.Errorf("CloneExec's child:\n%s%q\nsyscall.ForkExec's:\n%s%q", got, gotExtra, want, wantExtra)
	}
	for _, line := range []string{"uid 0 gid 0 groups 0 pid 1", "session leader", "SigBlk:\t0000000000000000", "cwd /", "0 1 2 3 "} {
		if !strings.Contains(got, line) {
			t.Errorf("CloneExec's child lacks %q", line)
		}
	}
	if gotExtra != "to-fd-3\n" {
		t.Errorf("the child's descriptor 3 carried %q", gotExtra)
	}
}

// A child that cannot exec, or whose set-up fails, is reported as
// syscall.ForkExec reports it and leaves no process behind.
func TestCloneExecFails(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	attr := func(dir string) *syscall.ProcAttr {
		return &syscall.ProcAttr{Dir: dir, Files: []uintptr{0, 1, 2}, Sys: &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1<<20 + 4093*65536, Size: 65536}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1<<20 + 4093*65536, Size: 65536}},
			Credential:  &syscall.Credential{Uid: 0, Gid: 0},
		}}
	}
	missing := "/nonexistent-cage-test/missing" // t.TempDir is not the child's to search
	if _, err := CloneExec(missing, []string{"missing"}, attr("/")); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("exec of a missing file: %v; want ENOENT", err)
	}
	if _, err := CloneExec("/bin/true", []string{"true"}, attr(missing)); !errors.Is(err, syscall.ENOENT) || !strings.Contains(err.Error(), "chdir") {
		t.Errorf("a missing directory: %v; want chdir's ENOENT", err)
	}
	bad := attr("/")
	bad.Sys.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 1<<20 + 4093*65536, Size: 1 << 40}}
	if _, err := CloneExec("/bin/true", []string{"true"}, bad); err == nil || !strings.Contains(err.Error(), "uid_map") {
		t.Errorf("a map the kernel refuses: %v; want the uid_map's error", err)
	}
	var ws syscall.WaitStatus
	if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); !errors.Is(err, syscall.ECHILD) {
		t.Errorf("a child left behind: pid %d, %v", pid, err)
	}
}
