package clitest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall/state"
)

// TestMicroVM: `cage run --wall microvm` as a user meets it: base by
// default, the command's output and exit code, the TCG warning where there
// is no usable KVM (on stderr, once the sandbox exists), one-line errors
// for a host template and a missing kernel, and nothing left behind.
func TestMicroVM(t *testing.T) {
	e := setup(t)
	kernels := testutil.KernelDir()
	store := os.Getenv("CAGE_TEMPLATES")
	_, qerr := exec.LookPath("qemu-system-x86_64")
	_, kerr := os.Stat(filepath.Join(kernels, "current"))
	_, berr := os.Stat(filepath.Join(store, "templates", "base.json"))
	if store == "" || qerr != nil || kerr != nil || berr != nil {
		testutil.SkipWall(t, "microvm", "QEMU, the guest kernel (scripts/kernel.sh) or the base template is missing")
	}
	env := []string{"CAGE_KERNEL_DIR=" + kernels, "CAGE_TEMPLATES=" + store}

	r := e.cageEnv(nil, env, "run", "--wall", "microvm", "--", "sh", "-c", "uname -r; id -un; python3 -c 'print(6*7)'; exit 3")
	if r.code != 3 || !strings.HasSuffix(r.stdout, "user\n42\n") || strings.Contains(r.stdout, hostRelease(t)) {
		t.Errorf("microvm run: %v; want exit 3, the guest's kernel, user, 42", r)
	}
	// The accelerator cage chose (its probe's answer, kept for this boot).
	choice, err := os.ReadFile(filepath.Join(filepath.Dir(state.IDLockDir), "microvm-accel.json"))
	if err != nil {
		t.Fatal(err)
	}
	tcg := strings.Contains(string(choice), `"accel":"tcg"`)
	if warned := strings.Contains(r.stderr, "not a security boundary"); warned != tcg {
		t.Errorf("TCG chosen: %v, but warned: %v: %q", tcg, warned, r.stderr)
	}
	e.noLeftovers(r.ids...)

	for _, tc := range []struct {
		env  []string
		args []string
		code int
		want string
	}{
		{env, []string{"run", "--wall", "microvm", "--template", "host", "--", "true"}, exitUsage, "image templates"},
		{[]string{"CAGE_KERNEL_DIR=/nonexistent", "CAGE_TEMPLATES=" + store}, []string{"run", "--wall", "microvm", "--", "true"}, 69, "scripts/kernel.sh"},
	} {
		r := e.cageEnv(nil, tc.env, tc.args...)
		if r.code != tc.code || r.stdout != "" {
			t.Errorf("cage %s: %v; want exit %d and no output", strings.Join(tc.args, " "), r, tc.code)
		}
		oneLine(t, "cage "+strings.Join(tc.args, " "), r.stderr, tc.want)
		e.noLeftovers(r.ids...)
	}
}

// hostRelease is this host's kernel release.
func hostRelease(t *testing.T) string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}
