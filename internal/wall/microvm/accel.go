package microvm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"

	"github.com/cagehq/cage/internal/vm"
)

// TCGWarning is what cage says wherever a microvm runs under TCG: QEMU's
// own security policy treats TCG as no boundary against a hostile guest.
const TCGWarning = "microvm under TCG (software emulation): for development and CI, not a security boundary"

// accelChoice is the cached answer of Accel.
type accelChoice struct {
	Key    string `json:"key"`
	Accel  string `json:"accel"`
	Reason string `json:"reason,omitempty"`
}

// Accel chooses the microvm wall's accelerator: "kvm" when a guest really
// boots under it here (vm.ProbeKVM), else "tcg", with why KVM was not
// chosen. The probe takes up to 10 s when KVM does not work, so the answer
// is kept in the file choice for this boot of the host and this kernel and
// QEMU (a file every cage process on the host shares); a host without
// /dev/kvm is not probed. cache is where the probe's initramfs is built.
func Accel(ctx context.Context, cache, choice string, k *vm.Kernel, agentPath string) (accel, reason string) {
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	sh, err := shapeOf(vm.Config{Kernel: k})
	if err != nil {
		return "tcg", err.Error()
	}
	key := strings.TrimSpace(string(boot)) + " " + sh.Version + " " + sh.QEMU
	var c accelChoice
	if b, err := os.ReadFile(choice); err == nil && json.Unmarshal(b, &c) == nil && c.Key == key {
		return c.Accel, c.Reason
	}
	c = accelChoice{Key: key, Accel: "tcg"}
	if _, err := os.Stat("/dev/kvm"); err != nil {
		c.Reason = "no /dev/kvm"
	} else {
		initrd, err := Initramfs(cache, k, agentPath)
		if err != nil {
			return "tcg", err.Error()
		}
		if ok, why := vm.ProbeKVM(ctx, k, initrd); ok {
			c.Accel = "kvm"
		} else {
			c.Reason = why
		}
	}
	if ctx.Err() == nil {
		_ = writeChoice(choice, c)
	}
	return c.Accel, c.Reason
}

// writeChoice replaces the file p with c, whole.
func writeChoice(p string, c accelChoice) error {
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o711); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(p), ".microvm-accel-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(f.Name(), p)
}
