package process

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/wall"
)

// sendVolumes sends the child, on the socket its root came on, a copy of
// each volume's mount idmapped through the child's own user namespace
// (wall.Volume.Clone); the child attaches them (child.mountVolumes).
func (sb *Sandbox) sendVolumes(vols []wall.Volume, sock *os.File) error {
	ns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", sb.pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("the sandbox's user namespace: %w", err)
	}
	defer unix.Close(ns)
	for _, v := range vols {
		fd, err := v.Clone(ns)
		if err != nil {
			return err
		}
		err = unix.Sendmsg(int(sock.Fd()), []byte("volume"), unix.UnixRights(fd), nil, 0)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("send the sandbox the volume at %s: %w", v.Path, err)
		}
	}
	return nil
}

// VolumesMissing is nil: the process wall mounts volumes.
func (d *Driver) VolumesMissing() error { return nil }
