package sandbox

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cagehq/cage/internal/spawner"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/microvm"
	"github.com/cagehq/cage/internal/wall/oci"
	"github.com/cagehq/cage/internal/wall/process"
)

// Walls lists every wall cage knows, in order of hardness; the first is
// the default.
var Walls = []string{"process", "runc", "gvisor", "microvm"}

// drivers is the one table of walls: each driver probes the host for
// itself. Nothing else names a wall to pick its code.
func (h *Host) drivers() map[string]wall.Driver {
	h.wallsOnce.Do(func() {
		kernels := h.KernelDir
		if kernels == "" {
			kernels = KernelDir()
		}
		ociCfg := oci.Config{AgentPath: h.AgentPath, RunDir: h.RunDir, Cgroups: h.Cgroups, Log: h.Log}
		procCfg := process.Config{AgentPath: h.AgentPath, RunDir: h.RunDir, Cgroups: h.Cgroups, Log: h.Log}
		if h.SpawnAgents {
			procCfg.Spawner = spawner.New(h.AgentPath, h.Log)
		}
		all := []wall.Driver{
			process.NewDriver(procCfg),
			oci.NewRunc(ociCfg),
			oci.NewGVisor(ociCfg),
			microvm.NewDriver(microvm.DriverConfig{RunDir: h.RunDir, Cache: h.microvmCache(), AgentPath: h.AgentPath,
				KernelDir: kernels, Cgroups: h.Cgroups, Log: h.Log}),
		}
		h.walls = map[string]wall.Driver{}
		for _, d := range all {
			h.walls[d.Name()] = d
		}
	})
	return h.walls
}

// Driver is the wall named name ("" is the default, process).
func (h *Host) Driver(name string) (wall.Driver, error) {
	if name == "" {
		name = Walls[0]
	}
	d, ok := h.drivers()[name]
	if !ok {
		return nil, fmt.Errorf("%w: unknown wall %q (walls: %v)", ErrInvalid, name, Walls)
	}
	return d, nil
}

// DefaultTemplate is the template a sandbox of the wall starts from when
// its request names none: host, unless the driver has its own.
func (h *Host) DefaultTemplate(name string) string {
	if d, err := h.Driver(name); err == nil {
		if dt, ok := d.(wall.DefaultTemplater); ok {
			return dt.DefaultTemplate()
		}
	}
	return "host"
}

// WallMissing explains why a wall is not available here (nil when it is).
func (h *Host) WallMissing(name string) error {
	d, err := h.Driver(name)
	if err != nil {
		return err
	}
	return d.Missing()
}

// Describe is a wall's note for people (cage doctor), "" for none.
func (h *Host) Describe(ctx context.Context, name string) string {
	if d, err := h.Driver(name); err == nil {
		if ds, ok := d.(wall.Describer); ok {
			return ds.Describe(ctx)
		}
	}
	return ""
}

// Warning is what a user must be told when creating a sandbox on a wall
// here ("" for nothing): e.g. that the microvm wall under TCG is no
// boundary.
func (h *Host) Warning(ctx context.Context, name string) string {
	if d, err := h.Driver(name); err == nil {
		if ds, ok := d.(wall.Describer); ok {
			return ds.Warning(ctx)
		}
	}
	return ""
}

// RunBare runs argv directly in a wall's runtime, in the sandbox its
// driver would make from default options, without the agent: the peer
// cage's walls are measured against.
func (h *Host) RunBare(ctx context.Context, wallName string, argv []string, out io.Writer) error {
	d, err := h.Driver(wallName)
	if err != nil {
		return err
	}
	br, ok := d.(wall.BareRunner)
	if !ok {
		return fmt.Errorf("%w: the %s wall has no bare run to compare with", ErrUnavailable, wallName)
	}
	o := Options{Wall: wallName}
	p, err := h.Begin(ctx, &o)
	if err != nil {
		return err
	}
	spec := p.Spec()
	spec.Limits.Pids = o.Pids // no agent
	return br.RunBare(ctx, spec, argv, out)
}

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

// microvmCache is where the microvm wall keeps template images, initramfs
// and snapshots: beside the template store (DATA/microvm), else in the run
// directory.
func (h *Host) microvmCache() string {
	if h.Templates != nil {
		return filepath.Join(filepath.Dir(h.Templates.Dir()), "microvm")
	}
	return filepath.Join(h.RunDir, "microvm")
}
