package sandbox

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/oci"
)

// Walls lists every wall cage knows, in order of hardness.
var Walls = []string{"process", "runc", "gvisor", "microvm"}

// ProbeRuntimes finds the OCI runtimes this host has: runc on the PATH, and
// runsc ($CAGE_RUNSC, else on the PATH). gVisor runs with the systrap
// platform (KVM is used only where a probe shows it works; not yet), no
// network, and host sockets it may connect to (the agent's channel) but
// never create.
func ProbeRuntimes() map[string]*oci.Runtime {
	rts := map[string]*oci.Runtime{}
	if p, err := exec.LookPath("runc"); err == nil {
		rts["runc"] = &oci.Runtime{Wall: "runc", Binary: p}
	}
	runsc := os.Getenv("CAGE_RUNSC")
	if runsc == "" {
		runsc, _ = exec.LookPath("runsc")
	}
	if runsc != "" {
		if _, err := os.Stat(runsc); err == nil {
			rts["gvisor"] = &oci.Runtime{Wall: "gvisor", Binary: runsc,
				Flags: []string{"--platform=systrap", "--network=none", "--host-uds=open"}}
		}
	}
	return rts
}

// WallMissing explains why a wall is not available here.
func (h *Host) WallMissing(name string) error {
	switch name {
	case "", "process":
		return nil
	case "runc":
		if h.Runtimes["runc"] == nil {
			return fmt.Errorf("%w: the runc wall needs runc (apt-get install runc)", ErrUnavailable)
		}
	case "gvisor":
		if h.Runtimes["gvisor"] == nil {
			return fmt.Errorf("%w: the gvisor wall needs runsc (make runsc, or set CAGE_RUNSC)", ErrUnavailable)
		}
	case "microvm":
		return h.microvmMissing()
	default:
		return fmt.Errorf("%w: unknown wall %q (walls: %v)", ErrInvalid, name, Walls)
	}
	return nil
}

func (h *Host) createOCI(ctx context.Context, o Options) (wall.Sandbox, error) {
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
	o.identify()
	netHost, err := h.network(o.Net)
	if err != nil {
		return nil, err
	}
	sb, err := oci.Create(ctx, oci.Config{
		ID: o.ID, AgentPath: h.AgentPath, RunDir: h.RunDir, Cgroups: h.Cgroups, Runtime: h.Runtimes[o.Wall],
		Template: tmpl, Limits: cgroups.Limits{MemoryBytes: o.Memory, CPUs: o.CPUs, Pids: o.Pids + inside.AgentThreads},
		DiskBytes: o.Disk, ShmBytes: o.Shm, Token: o.Token, Env: tmpl.EnvWith(o.Env), MaxOutput: o.MaxOutput,
		Threads: inside.AgentThreads, DieWithCaller: o.DieWithCaller, Log: h.Log,
		Net: netHost, NetPolicy: o.Net,
	})
	if err != nil {
		return nil, err
	}
	if err := startCommand(sb, tmpl); err != nil {
		_ = sb.Destroy()
		return nil, err
	}
	return sb, nil
}

// RunBare runs argv directly as the container process of an OCI wall, in a
// bundle built as a sandbox's, without the agent: the peer cage's OCI walls
// are measured against.
func (h *Host) RunBare(ctx context.Context, wallName string, argv []string, out io.Writer) error {
	if err := h.WallMissing(wallName); err != nil {
		return err
	}
	o := Options{Wall: wallName}
	if err := o.Validate(); err != nil {
		return err
	}
	tmpl, err := h.lookup(o.Template)
	if err != nil {
		return err
	}
	return oci.RunBare(ctx, oci.Config{
		ID: ids.NewID(), AgentPath: h.AgentPath, RunDir: h.RunDir, Cgroups: h.Cgroups, Runtime: h.Runtimes[wallName],
		Template: tmpl, Limits: cgroups.Limits{MemoryBytes: o.Memory, CPUs: o.CPUs, Pids: o.Pids},
		DiskBytes: o.Disk, ShmBytes: o.Shm, Log: h.Log,
	}, argv, out)
}
