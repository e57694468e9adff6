package oci

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/template"
)

// Volumes under the OCI walls: the runtime takes bind mounts of host
// paths, so each volume's mount is cloned from the host's descriptor of it
// (wall.Volume.Clone) and attached at sandboxes/ID/volumes/N, a directory
// of the sandbox's state that only the host writes; the bundle binds that.
// Under runc the copy is idmapped onto the sandbox's uid range (through
// the user namespace held for the range), so the volume keeps the ids the
// sandbox sees; gVisor serves host ids as they are, so its copy is plain.
// Teardown detaches them with the state directory.

// attachVolumes attaches a copy of each volume of cfg under the state
// directory and returns the bundle's binds of them.
func (sb *Sandbox) attachVolumes(cfg job) ([]specs.Mount, error) {
	if len(cfg.Volumes) == 0 {
		return nil, nil
	}
	base := filepath.Join(sb.dir, "volumes")
	if err := os.Mkdir(base, 0o711); err != nil {
		return nil, err
	}
	ns := -1
	if !cfg.Runtime.gvisor() {
		var err error
		if ns, err = template.HeldUserNS(uint32(sb.ids.Base), cfg.AgentPath)(); err != nil {
			return nil, fmt.Errorf("user namespace for the volumes: %w", err)
		}
	}
	var mounts []specs.Mount
	for i, v := range cfg.Volumes {
		dir := filepath.Join(base, strconv.Itoa(i))
		if err := os.Mkdir(dir, 0o711); err != nil {
			return nil, err
		}
		fd, err := v.Clone(ns)
		if err != nil {
			return nil, err
		}
		err = unix.MoveMount(fd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH)
		unix.Close(fd)
		if err != nil {
			return nil, fmt.Errorf("attach the volume at %s: %w", v.Path, err)
		}
		mounts = append(mounts, bind(v.Path, dir, "rbind", "rw", "nosuid", "nodev"))
	}
	return mounts, nil
}

// VolumesMissing is nil: runc and gVisor mount volumes.
func (d *Driver) VolumesMissing() error { return nil }
