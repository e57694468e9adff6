package oci

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
)

// Under runc the host template's directories (the host's /usr, the cached
// /etc every sandbox of the template shares) are each sandbox's own
// read-only overlay, as on the process wall: its inodes are then its own,
// and an inotify watch in it sees its own opens only (a bind shares the
// host's inodes, whose events are the host's and every other sandbox's).
// runc mounts by path, and an overlay it mounted from config.json would
// name its layers by their host paths in the sandbox's mountinfo; so cage
// makes the overlays itself, as the process wall's child does (layers by
// detached mount: inside.ReadOnlyDir), in a mount namespace of runc's own
// (runAt), on the mount points in the sandbox's layers directory, and
// config.json binds them from there. The binds keep the overlay's
// superblock, and with it its inodes.
//
// The overlays exist only in that namespace, whose propagation to the
// host's is cut (slave: the host's mounts still reach it, as they reached
// runc before), and in the container's, copied from it as runc starts the
// container. Once runc exits (run --detach: when it has started the
// container, or failed to), no process is left in the namespace and it
// goes with what it holds: the host's namespace never holds them, so
// there is nothing to unmount at destroy, after a failed create, or for a
// daemon adopting the sandbox after a restart. On the host the layers
// directory holds empty mount points, removed with the sandbox's
// directory. What is mounted, and where, are paths of the host's only:
// the template's sources and the sandbox's state directory, which the
// sandbox cannot write. (runc has no checkpoints here: see checkpoint.go.)
// gVisor binds the host's: its sentry is a kernel of its own, whose
// watches see its own.

// layersDir is the directory, in the sandbox's, of the mount points.
const layersDir = "layers"

// layerPath is the mount point of the template's i-th entry (a directory).
func layerPath(dir string, i int) string { return filepath.Join(dir, strconv.Itoa(i)) }

// mountLayers mounts each directory of the template's mounts on its mount
// point in dir (made by hostRoot). It runs in runc's own mount namespace
// (see runAt), whose mounts reach no other.
func mountLayers(dir string, mounts []inside.Mount) error {
	empty, done, err := inside.EmptyLower(filepath.Join(dir, "lower"))
	if err != nil {
		return err
	}
	defer done()
	for i, m := range mounts {
		if m.Kind != inside.Dir {
			continue
		}
		if err := inside.ReadOnlyDir(m.Source, empty, layerPath(dir, i), unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV); err != nil {
			return fmt.Errorf("template entry %s: %w", m.Dest, err)
		}
	}
	return nil
}

// makeLayerPoints makes dir and the mount points mountLayers mounts on.
func makeLayerPoints(dir string, mounts []inside.Mount) error {
	// Traversable, as the sandbox's directory is by the container's root
	// (a runtime may open the binds' sources as it): it holds nothing
	// but the mount points, and in runc's namespace what they show the
	// container anyway.
	if err := os.Mkdir(dir, 0o711); err != nil && !os.IsExist(err) {
		return err
	}
	for i, m := range mounts {
		if m.Kind != inside.Dir {
			continue
		}
		if err := os.Mkdir(layerPath(dir, i), 0o755); err != nil && !os.IsExist(err) {
			return err
		}
	}
	return nil
}
