package oci

import (
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/spawner"
)

// ownedNamespaces makes a runc sandbox's user namespace, its 0..65535
// mapped to the sandbox's host ids from base, and, when network is set, a
// network namespace with it; it returns descriptors holding them (netns
// -1 without). The bundle names them and runc joins them instead of making
// its own.
//
// runc runs as host root, so a user namespace it made would be host
// root's, and the kernel charges per-user counts (inotify instances,
// queued signals) at the host's level to a namespace's owner: one sandbox
// could use up host root's and every other sandbox's. This one is owned by
// the sandbox root's own host uid (see spawner.ForkOwned), as the process
// wall's are. setgroups stays allowed: runc and the agent set groups.
//
// runc joins the user namespace first, and from inside it may join only
// namespaces it owns: so a networked sandbox's network namespace is made
// here, owned by it (as on the process wall), not by the host as gVisor's
// (network.NewNamespace). Commands hold no capabilities in it (the seal),
// and the host's rules, on its side of the veth, are what bound its
// traffic.
func ownedNamespaces(base int, holder string, network bool) (userns, netns int, err error) {
	m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}}
	flags := uintptr(syscall.CLONE_NEWUSER)
	if network {
		flags |= syscall.CLONE_NEWNET
	}
	// The holder lives until its stdin ends. It starts by
	// spawner.CloneExec, which shares the daemon's memory until its exec
	// instead of copying it (exec.Cmd's fork copied the daemon's page
	// tables and made it fault on its own memory afterwards).
	in, out, err := os.Pipe()
	if err != nil {
		return -1, -1, err
	}
	defer out.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		in.Close()
		return -1, -1, err
	}
	defer devnull.Close()
	attr := &syscall.ProcAttr{
		Files: []uintptr{in.Fd(), devnull.Fd(), devnull.Fd()},
		Sys: &syscall.SysProcAttr{Cloneflags: flags, UidMappings: m, GidMappings: m,
			GidMappingsEnableSetgroups: true, Pdeathsig: syscall.SIGKILL},
	}
	pid, err := spawner.ForkOwned(base, base, func() (int, error) {
		return spawner.CloneExec(holder, []string{holder, "hold"}, attr)
	})
	in.Close()
	if err != nil {
		return -1, -1, fmt.Errorf("the sandbox's namespaces: %w", err)
	}
	defer func() {
		out.Close() // the holder exits; the descriptors keep the namespaces
		var ws unix.WaitStatus
		for {
			if _, err := unix.Wait4(pid, &ws, 0, nil); err != unix.EINTR {
				break
			}
		}
	}()
	open := func(ns string) (int, error) {
		return unix.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, ns), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	if userns, err = open("user"); err != nil {
		return -1, -1, fmt.Errorf("the sandbox's user namespace: %w", err)
	}
	netns = -1
	if network {
		if netns, err = open("net"); err != nil {
			unix.Close(userns)
			return -1, -1, fmt.Errorf("the sandbox's network namespace: %w", err)
		}
	}
	return userns, netns, nil
}
