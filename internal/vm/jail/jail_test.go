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
	spec, _ := json.Marshal(jail.Spec{UID: 60000, GID: 60000, Groups: []uint32{}, Lifeline: 3})
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
