package microvm

import (
	"os"
	"os/exec"
	"strings"

	"github.com/cagehq/cage/internal/vm"
)

// Info says what this host has of the microvm wall: QEMU, the guest
// kernel in kernelDir, and /dev/kvm (used only if a guest really boots
// under it: Driver.Accel probes once per boot).
func Info(kernelDir string) string {
	var parts []string
	if p, err := exec.LookPath(vm.QEMU); err == nil {
		parts = append(parts, p)
	} else {
		parts = append(parts, "no QEMU")
	}
	if k, err := vm.FindKernel(kernelDir); err == nil {
		parts = append(parts, "guest kernel "+k.Version)
	} else {
		parts = append(parts, "no guest kernel (scripts/kernel.sh)")
	}
	if _, err := os.Stat("/dev/kvm"); err == nil {
		parts = append(parts, "/dev/kvm present (KVM counts only once a guest boots under it)")
	} else {
		parts = append(parts, "no /dev/kvm")
	}
	return strings.Join(parts, "; ")
}
