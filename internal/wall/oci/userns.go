package oci

import (
	"fmt"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/spawner"
)

// ownedUserNS makes a runc sandbox's user namespace, its 0..65535 mapped
// to the sandbox's host ids from base, and returns a descriptor holding
// it; the bundle names it and runc joins it instead of making one.
//
// runc runs as host root, so a namespace it made would be host root's, and
// the kernel charges per-user counts (inotify instances, queued signals)
// at the host's level to a namespace's owner: one sandbox could use up
// host root's and every other sandbox's. This one is owned by the
// sandbox root's own host uid (see spawner.ForkOwned), as the process
// wall's are. setgroups stays allowed: runc and the agent set groups.
func ownedUserNS(base int, holder string) (int, error) {
	m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}}
	cmd := exec.Command(holder, "hold")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER, UidMappings: m, GidMappings: m,
		GidMappingsEnableSetgroups: true, Pdeathsig: syscall.SIGKILL}
	in, err := cmd.StdinPipe()
	if err != nil {
		return -1, err
	}
	defer in.Close()
	if _, err := spawner.ForkOwned(base, base, func() (int, error) {
		if err := cmd.Start(); err != nil {
			return 0, err
		}
		return cmd.Process.Pid, nil
	}); err != nil {
		if cmd.Process != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		return -1, fmt.Errorf("the sandbox's user namespace: %w", err)
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	in.Close() // the holder exits; the descriptor keeps the namespace
	_ = cmd.Wait()
	if err != nil {
		return -1, fmt.Errorf("the sandbox's user namespace: %w", err)
	}
	return fd, nil
}
