package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/microvm"
	"github.com/cagehq/cage/internal/wall/state"
)

// MicroVMTemplate is the template of a microvm sandbox that names none:
// the built-in host template is the host's own files, which no VM is
// given (the guest sees nothing of the host but read-only template
// images), so a microvm starts from an image, base by default.
const MicroVMTemplate = "base"

// KernelDir is where the microvm wall's guest kernel is looked for:
// $CAGE_KERNEL_DIR, else .tools/kernel beside the directory of the running
// executable (where `make` puts cage and scripts/kernel.sh the kernel).
func KernelDir() string {
	if dir := os.Getenv("CAGE_KERNEL_DIR"); dir != "" {
		return dir
	}
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	return filepath.Join(filepath.Dir(filepath.Dir(exe)), ".tools", "kernel")
}

// microvmMissing explains what the microvm wall lacks here, nil if nothing.
func (h *Host) microvmMissing() error {
	if _, err := exec.LookPath(vm.QEMU); err != nil {
		return fmt.Errorf("%w: the microvm wall needs QEMU (scripts/kernel.sh installs qemu-system-x86)", ErrUnavailable)
	}
	if _, err := exec.LookPath("mke2fs"); err != nil {
		return fmt.Errorf("%w: the microvm wall needs mke2fs (apt-get install e2fsprogs)", ErrUnavailable)
	}
	if _, err := h.kernel(); err != nil {
		return fmt.Errorf("%w: the microvm wall needs a guest kernel (scripts/kernel.sh, or set CAGE_KERNEL_DIR): %v", ErrUnavailable, err)
	}
	return nil
}

// kernel finds the guest kernel once.
func (h *Host) kernel() (*vm.Kernel, error) {
	h.kernelOnce.Do(func() {
		dir := h.KernelDir
		if dir == "" {
			dir = KernelDir()
		}
		h.guestKernel, h.kernelErr = vm.FindKernel(dir)
	})
	return h.guestKernel, h.kernelErr
}

// MicroVMAccel is the microvm wall's accelerator here and, for TCG, why
// KVM is not used (microvm.Accel), decided once per Host. Callers say
// microvm.TCGWarning to their users under TCG.
func (h *Host) MicroVMAccel(ctx context.Context) (accel, why string) {
	h.accelOnce.Do(func() {
		k, err := h.kernel()
		if err != nil {
			h.accel, h.accelWhy = "tcg", err.Error()
			return
		}
		choice := filepath.Join(filepath.Dir(state.IDLockDir), "microvm-accel.json")
		h.accel, h.accelWhy = microvm.Accel(ctx, h.microvmCache(), choice, k, h.AgentPath)
	})
	return h.accel, h.accelWhy
}

// microvmCache is where the microvm wall keeps template images, initramfs
// and snapshots: beside the template store (DATA/microvm), else in the run
// directory.
func (h *Host) microvmCache() string {
	if h.Templates != nil {
		return filepath.Join(filepath.Dir(h.Templates.Dir()), "microvm")
	}
	return filepath.Join(h.RunDir, "microvm")
}

func (h *Host) createMicroVM(ctx context.Context, o Options) (wall.Sandbox, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if err := h.WallMissing(o.Wall); err != nil {
		return nil, err
	}
	tmpl, err := h.lookup(o.Template)
	if err != nil {
		return nil, err
	}
	if tmpl.Image == nil {
		return nil, fmt.Errorf("%w: the microvm wall runs image templates, not %q (the host's own files, which no VM is given); use --template %s or another image", ErrInvalid, o.Template, MicroVMTemplate)
	}
	k, err := h.kernel()
	if err != nil {
		return nil, err
	}
	netHost, err := h.network(o.Net)
	if err != nil {
		return nil, err
	}
	o.identify()
	accel, _ := h.MicroVMAccel(ctx)
	sb, err := microvm.Create(ctx, microvm.Config{
		ID: o.ID, RunDir: h.RunDir, Cache: h.microvmCache(), AgentPath: h.AgentPath, Kernel: k, Template: tmpl, Accel: accel,
		Limits:  cgroups.Limits{MemoryBytes: o.Memory, CPUs: o.CPUs, Pids: o.Pids + inside.AgentThreads},
		Cgroups: h.Cgroups, DiskBytes: o.Disk, ShmBytes: o.Shm, Token: o.Token, Env: tmpl.EnvWith(o.Env), MaxOutput: o.MaxOutput,
		Threads: inside.AgentThreads, Log: h.Log, Net: netHost, NetPolicy: o.Net,
	})
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return nil, err
		}
		return nil, fmt.Errorf("microvm: %w", err)
	}
	if err := startCommand(sb, tmpl); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	return sb, nil
}
