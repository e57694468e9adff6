// Package boot is the guest's side of a microVM's boot, run as PID 1 inside
// the VM: /dev, /proc and /sys, the virtio modules in the initramfs's
// order, the agent's virtio-serial port. It imports nothing of the host's:
// it is in cage-agent, which is the guest's init.
package boot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// AgentPort is the name of the virtio-serial port between the host and the
// agent.
const AgentPort = "agent"

// ModulesOrder is where the initramfs lists the modules GuestSetup loads,
// one absolute path a line, in load order.
const ModulesOrder = "/modules.order"

// portWait bounds how long GuestSetup waits for the agent port to appear:
// the host announces ports after the driver has loaded, asynchronously.
const portWait = 5 * time.Second

// GuestSetup prepares the guest for the agent; it runs as PID 1 inside the
// VM. It mounts devtmpfs on /dev, proc on /proc and sysfs on /sys, loads the
// modules listed in ModulesOrder, waits for the agent port and returns it
// opened for reading and writing. Writes to the port block until the host
// has connected to its socket; reads end (EOF) while no host is connected.
func GuestSetup() (*os.File, error) {
	mounts := []struct {
		fstype, target string
		flags          uintptr
		data           string
	}{
		{"devtmpfs", "/dev", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0755"},
		{"proc", "/proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
		{"sysfs", "/sys", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	}
	for _, m := range mounts {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return nil, fmt.Errorf("guest setup: %w", err)
		}
		if err := unix.Mount(m.fstype, m.target, m.fstype, m.flags, m.data); err != nil {
			return nil, fmt.Errorf("guest setup: mount %s on %s: %w", m.fstype, m.target, err)
		}
	}
	if err := loadModules(ModulesOrder); err != nil {
		return nil, err
	}
	return openPort(AgentPort, portWait)
}

func loadModules(orderFile string) error {
	data, err := os.ReadFile(orderFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil // a kernel with every driver built in
	}
	if err != nil {
		return fmt.Errorf("guest setup: %w", err)
	}
	for _, p := range strings.Fields(string(data)) {
		if err := loadModule(p); err != nil {
			return err
		}
	}
	return nil
}

func loadModule(p string) error {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("guest setup: open module %s: %w", p, err)
	}
	defer unix.Close(fd)
	flags := 0
	if Compression(p) != "" {
		flags |= unix.MODULE_INIT_COMPRESSED_FILE
	}
	// EEXIST: loaded already, or built in after all; either way it is there.
	if err := unix.FinitModule(fd, "", flags); err != nil && err != unix.EEXIST {
		return fmt.Errorf("guest setup: load module %s: %w", p, err)
	}
	return nil
}

// Where the guest's devtmpfs and sysfs are (see KeepDevices).
var devDir, sysDir = "/dev", "/sys"

// KeepDevices keeps the guest's devtmpfs and sysfs reachable for
// ReopenAgentPort once the root has changed to one that shows neither
// (the sandbox's minimal /dev, and no /sys): through descriptors of their
// directories, held for the guest's life and closed on exec (no command
// may hold the guest's devtmpfs or sysfs).
func KeepDevices() error {
	for _, d := range []*string{&devDir, &sysDir} {
		fd, err := unix.Open(*d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("keep %s: %w", *d, err)
		}
		*d = "/proc/self/fd/" + strconv.Itoa(fd)
	}
	return nil
}

// ReopenAgentPort opens the agent port again, after the guest has closed
// it to take a new host (a snapshot's guest does, before it is saved).
func ReopenAgentPort() (*os.File, error) {
	deadline := time.Now().Add(portWait)
	for {
		f, err := openPort(AgentPort, portWait)
		// EBUSY: the port takes one opener, and the last close of the old
		// descriptor may still be under way.
		if err == nil || !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return f, err
		}
		time.Sleep(time.Millisecond)
	}
}

// openPort waits up to wait for the virtio-serial port called name and
// opens its device.
func openPort(name string, wait time.Duration) (*os.File, error) {
	deadline := time.Now().Add(wait)
	for {
		dev, err := findPort(name)
		if err == nil && dev != "" {
			// The device node may trail the sysfs entry by a moment.
			f, err := os.OpenFile(dev, os.O_RDWR, 0)
			if err == nil {
				return f, nil
			}
			if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
				return nil, fmt.Errorf("guest setup: open the %s port: %w", name, err)
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("guest setup: no virtio-serial port named %q appeared within %s", name, wait)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// findPort returns the device of the port called name, "" if none is there
// yet.
func findPort(name string) (string, error) {
	names, err := filepath.Glob(sysDir + "/class/virtio-ports/*/name")
	if err != nil {
		return "", err
	}
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			continue // a port going away, or its name not yet set
		}
		if strings.TrimSpace(string(b)) == name {
			return devDir + "/" + filepath.Base(filepath.Dir(n)), nil
		}
	}
	return "", nil
}

// Compression is how a module file is compressed: "", "xz", "zst" or "gz".
func Compression(path string) string {
	for _, c := range []string{"xz", "zst", "gz"} {
		if strings.HasSuffix(path, ".ko."+c) {
			return c
		}
	}
	return ""
}
