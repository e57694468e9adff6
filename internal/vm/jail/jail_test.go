package jail_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/vm/jail"
)

// probe runs in QEMU's place: it lists the directories it holds open and
// describes its session keyring, and searches it for the host's key.
const probe = `
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for fd in os.listdir("/proc/self/fd"):
    p = "/proc/self/fd/" + fd
    if os.path.isdir(p) and os.path.exists(p + "/host-secret"):
        print("LEAKED", fd)
buf = ctypes.create_string_buffer(256)
n = libc.syscall(250, 6, ctypes.c_long(-3), buf, 256)  # keyctl(KEYCTL_DESCRIBE, @s)
print("session", buf.value.decode() if n > 0 else "none")
k = libc.syscall(250, 10, ctypes.c_long(-3), b"user", b"cage-test-key", 0)  # KEYCTL_SEARCH
print("found" if k > 0 else "not found")
`

// TestJailInheritsNothing: QEMU's jail hands it the descriptors it was
// given and nothing else a fork of the host inherited (a volume's root,
// dup'ed without close-on-exec, once reached QEMU: a compromised QEMU read
// another tenant's volume), and a session keyring of its own (it possessed
// the daemon's: read its keys, added, revoked; found by review,
// 2026-12-03).
func TestJailInheritsNothing(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("no /usr/bin/python3 for the probe")
	}
	agent := filepath.Join(testutil.Binaries(t), "cage-agent")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "host-secret"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	leak, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0) // no O_CLOEXEC: a slip elsewhere
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(leak)

	// The host's thread gets a session keyring of its own with a key in
	// it (as a service under systemd has), and starts the jail from it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	name := []byte("cage-test-session\x00")
	if _, _, e := unix.RawSyscall(unix.SYS_KEYCTL, unix.KEYCTL_JOIN_SESSION_KEYRING, uintptr(unsafe.Pointer(&name[0])), 0); e != 0 {
		t.Skipf("keyctl join: %v", e)
	}
	if _, err := unix.AddKey("user", "cage-test-key", []byte("host's"), unix.KEY_SPEC_SESSION_KEYRING); err != nil {
		t.Skipf("add_key: %v", err)
	}
	lr, lw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer lw.Close()
	spec, _ := json.Marshal(jail.Spec{UID: 60000, GID: 60000, Groups: []uint32{}, Lifeline: 3, FileBytes: 1 << 20})
	cmd := exec.Command(agent, jail.Arg, string(spec), "/usr/bin/python3", "-c", probe)
	cmd.Args[0] = "cage-agent"
	cmd.Dir, cmd.Env = "/", []string{}
	cmd.ExtraFiles = []*os.File{lr}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Cloneflags: jail.Flags}
	out, err := cmd.CombinedOutput()
	lr.Close()
	if err != nil {
		t.Fatalf("jail: %v: %s", err, out)
	}
	got := string(out)
	if strings.Contains(got, "LEAKED") {
		t.Errorf("QEMU's place held a directory of the host's: %s", got)
	}
	if strings.Contains(got, "cage-test-session") || strings.Contains(got, "\nfound") {
		t.Errorf("QEMU's place possessed the host's session keyring: %s", got)
	}
	if !strings.Contains(got, "session ") || !strings.Contains(got, "not found") {
		t.Errorf("the probe said: %s", got)
	}
}

// hostileWriter runs in QEMU's place: it writes 2 MiB into the file it is
// handed (descriptor 3), then tries to grow it to 1 GiB by truncate and
// by fallocate, and to raise its own limit; it says how each went, and
// that it is still alive.
const hostileWriter = `
import errno, os, resource
fd, chunk, wrote, err = 3, b"x" * 65536, 0, "none"
try:
    while wrote < 2 << 20:
        wrote += os.write(fd, chunk)
except OSError as e:
    err = errno.errorcode[e.errno]
print("wrote", wrote, "error", err)
for name, grow in (("truncate", lambda: os.ftruncate(fd, 1 << 30)), ("fallocate", lambda: os.posix_fallocate(fd, 0, 1 << 30))):
    try:
        grow()
        print(name, "grew")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
except (OSError, ValueError):
    print("not raised")
print("alive")
`

// TestJailBoundsFiles: no file QEMU writes through a descriptor it is
// handed (a checkpoint's state) grows past the jail's bound. Hostile case:
// a "QEMU" writes 2 MiB into a file bounded at 1 MiB, truncates and
// fallocates it to 1 GiB and tries to lift its limit. Expected: its
// writes stop at 1 MiB with EFBIG, the rest fail with EFBIG (the limit
// with EPERM), the file holds 1 MiB, and the process lives on (SIGXFSZ
// ignored) to report it. Before, nothing bounded it: a compromised QEMU
// could fill the host's disk through a checkpoint (found by review,
// 2026-12-03). A jail without a bound is refused.
func TestJailBoundsFiles(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("no /usr/bin/python3 for the probe")
	}
	out, size, err := runJailed(t, 1<<20, hostileWriter)
	if err != nil {
		t.Fatalf("jail: %v: %s", err, out)
	}
	t.Logf("bounded at 1 MiB: %q, file %d bytes", out, size)
	for _, want := range []string{"wrote 1048576 error EFBIG\n", "truncate EFBIG\n", "fallocate EFBIG\n", "not raised\n", "alive\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("the hostile writer did not report %q: %s", want, out)
		}
	}
	if size != 1<<20 {
		t.Errorf("the file holds %d bytes, not the bound's 1 MiB", size)
	}
	if out, _, err := runJailed(t, 0, hostileWriter); err == nil || !strings.Contains(out, "no bound") {
		t.Errorf("a jail without a file bound ran QEMU: %v: %s", err, out)
	}
}

// TestJailDumpsNoCore: QEMU's core limit is 1 byte, soft and hard, the
// value for which the kernel skips a pipe core_pattern (systemd-coredump,
// apport) and below a file core's page. Hostile case: a guest that makes
// QEMU abort (an assertion its devices reach) would otherwise have the
// host's helper run as root outside the sandbox's cgroups and read QEMU's
// memory, the VM's RAM, into the host's crash store, where the tenant's
// data outlives its sandbox (found by review, 2026-12-05: it had 0, no
// hard limit, and could raise it). Expected: the jailed process reads 1 1
// and cannot lift the limit.
func TestJailDumpsNoCore(t *testing.T) {
	testutil.RequireRoot(t)
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("no /usr/bin/python3 for the probe")
	}
	out, _, err := runJailed(t, 1<<20, `
import resource
print("core", *resource.getrlimit(resource.RLIMIT_CORE))
try:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("raised")
except (OSError, ValueError):
    print("not raised")
`)
	if err != nil {
		t.Fatalf("jail: %v: %s", err, out)
	}
	if out != "core 1 1\nnot raised\n" {
		t.Errorf("QEMU's core limit in the jail: %q, want \"core 1 1\\nnot raised\\n\"", out)
	}
}

// runJailed runs a Python script in the jail as QEMU would be run (uid
// 60000, file bound fileBytes, 0: none), with its state file (writable by
// the jailed user) and lifeline, and says what it printed and how large
// it left the state file.
func runJailed(t *testing.T, fileBytes int64, script string) (string, int64, error) {
	t.Helper()
	agent := filepath.Join(testutil.Binaries(t), "cage-agent")
	state, err := os.CreateTemp(t.TempDir(), "state")
	if err != nil {
		t.Fatal(err)
	}
	defer state.Close()
	if err := state.Chmod(0o666); err != nil {
		t.Fatal(err)
	}
	lr, lw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer lw.Close()
	spec, _ := json.Marshal(jail.Spec{UID: 60000, GID: 60000, Groups: []uint32{}, Lifeline: 4, FileBytes: fileBytes})
	cmd := exec.Command(agent, jail.Arg, string(spec), "/usr/bin/python3", "-c", script)
	cmd.Args[0] = "cage-agent"
	cmd.Dir, cmd.Env = "/", []string{}
	cmd.ExtraFiles = []*os.File{state, lr}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Cloneflags: jail.Flags}
	out, err := cmd.CombinedOutput()
	lr.Close()
	st, serr := state.Stat()
	if serr != nil {
		t.Fatal(serr)
	}
	return string(out), st.Size(), err
}
