package microvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"path/filepath"
	"sync"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// DefaultTemplate is the template of a microvm sandbox that names none:
// the built-in host template is the host's own files, which no VM is
// given (the guest sees nothing of the host but read-only template
// images), so a microvm starts from an image, base by default.
const DefaultTemplate = "base"

// DriverConfig is what the microvm wall needs of the host.
type DriverConfig struct {
	RunDir    string
	Cache     string // see Config.Cache
	AgentPath string
	KernelDir string // where the guest kernel is (scripts/kernel.sh)
	Cgroups   *cgroups.Manager
	Log       *slog.Logger
}

// Driver is the microvm wall.
type Driver struct {
	cfg DriverConfig

	kernelOnce sync.Once
	kernel     *vm.Kernel
	kernelErr  error
	accelOnce  sync.Once
	accel, why string
}

// NewDriver returns the microvm wall's driver.
func NewDriver(cfg DriverConfig) *Driver {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Driver{cfg: cfg}
}

// Name is "microvm".
func (d *Driver) Name() string { return "microvm" }

// DefaultTemplate is base: a VM is given images only.
func (d *Driver) DefaultTemplate() string { return DefaultTemplate }

// Missing says what the wall lacks here: QEMU, mke2fs, the guest kernel.
func (d *Driver) Missing() error {
	if _, err := exec.LookPath(vm.QEMU); err != nil {
		return fmt.Errorf("%w: the microvm wall needs QEMU (scripts/kernel.sh installs qemu-system-x86)", wall.ErrUnavailable)
	}
	if _, err := exec.LookPath("mke2fs"); err != nil {
		return fmt.Errorf("%w: the microvm wall needs mke2fs (apt-get install e2fsprogs)", wall.ErrUnavailable)
	}
	if _, err := d.guestKernel(); err != nil {
		return fmt.Errorf("%w: the microvm wall needs a guest kernel (scripts/kernel.sh, or set CAGE_KERNEL_DIR): %v", wall.ErrUnavailable, err)
	}
	return nil
}

func (d *Driver) guestKernel() (*vm.Kernel, error) {
	d.kernelOnce.Do(func() { d.kernel, d.kernelErr = vm.FindKernel(d.cfg.KernelDir) })
	return d.kernel, d.kernelErr
}

// Accel is the accelerator here and, for TCG, why KVM is not used (see
// Accel), decided once per driver.
func (d *Driver) Accel(ctx context.Context) (accel, why string) {
	d.accelOnce.Do(func() {
		k, err := d.guestKernel()
		if err != nil {
			d.accel, d.why = "tcg", err.Error()
			return
		}
		choice := filepath.Join(filepath.Dir(state.IDLockDir), "microvm-accel.json")
		d.accel, d.why = Accel(ctx, d.cfg.Cache, choice, k, d.cfg.AgentPath)
	})
	return d.accel, d.why
}

// Describe says the accelerator (and, for TCG, why and TCGWarning).
func (d *Driver) Describe(ctx context.Context) string {
	note := Info(d.cfg.KernelDir) + "; accelerator "
	accel, why := d.Accel(ctx)
	note += accel
	if accel == "tcg" {
		note += ": " + why + "; " + TCGWarning
	}
	return note
}

// Warning is TCGWarning where the wall runs without KVM.
func (d *Driver) Warning(ctx context.Context) string {
	if accel, why := d.Accel(ctx); accel == "tcg" {
		return TCGWarning + " (" + why + ")"
	}
	return ""
}

// Create restores (or boots) a VM for spec, whose template must be an image.
func (d *Driver) Create(ctx context.Context, spec wall.Spec) (wall.Sandbox, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	if spec.Template.Image == nil {
		return nil, fmt.Errorf("%w: the microvm wall runs image templates, not %q (the host's own files, which no VM is given); use --template %s or another image", wall.ErrInvalid, spec.Template.Name, DefaultTemplate)
	}
	k, _ := d.guestKernel()
	accel, _ := d.Accel(ctx)
	sb, err := Create(ctx, Config{Spec: spec, RunDir: d.cfg.RunDir, Cache: d.cfg.Cache, AgentPath: d.cfg.AgentPath,
		Kernel: k, Cgroups: d.cfg.Cgroups, Accel: accel, Log: d.cfg.Log})
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return nil, err
		}
		return nil, fmt.Errorf("microvm: %w", err)
	}
	return sb, nil
}

// Adopt cannot: QEMU ends with the process that started it, and the
// session to its agent with that process.
func (d *Driver) Adopt(a wall.Adoption) (wall.Sandbox, error) {
	return nil, fmt.Errorf("%w: a microvm sandbox ends with the process that created it", wall.ErrUnavailable)
}

// VolumesMissing says why the microvm wall does not mount volumes: no way
// to share a host directory with the guest holds here. Debian's cloud
// kernel has no 9p file system (only virtiofs); virtiofs needs virtiofsd,
// a host daemon outside QEMU's jail acting on the volume with the
// privileges to set every owner, and the guest's RAM shared with it, which
// the restore from a sealed snapshot mapped private rules out; and giving
// the guest the volume's block device would have the host mount a file
// system a hostile guest kernel wrote.
func (d *Driver) VolumesMissing() error {
	return fmt.Errorf("%w: the microvm wall cannot mount volumes (its guest kernel has no 9p, and virtiofs would need a host daemon with the guest's RAM shared); use the process, runc or gvisor wall for sandboxes with volumeMounts", wall.ErrInvalid)
}
