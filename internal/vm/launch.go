package vm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
)

// checkConfig refuses what QEMU cannot be started with.
func checkConfig(cfg Config) error {
	if cfg.Kernel == nil {
		return errors.New("no kernel")
	}
	if cfg.Accel != "" && cfg.Accel != "tcg" && cfg.Accel != "kvm" {
		return fmt.Errorf("accelerator %q is neither tcg nor kvm", cfg.Accel)
	}
	if cfg.Dir == "" {
		return errors.New("no directory")
	}
	if !fileExists(cfg.Initramfs) {
		return fmt.Errorf("no initramfs at %q", cfg.Initramfs)
	}
	if n := len(filepath.Join(cfg.Dir, AgentSocket)); n > maxSocketPath {
		return fmt.Errorf("directory %s is too long for a unix socket path", cfg.Dir)
	}
	if cfg.Credential != nil && cfg.Jailer == "" {
		return errors.New("a credential needs a jailer (cage-agent)")
	}
	return nil
}

// listenSockets makes the VM's directory (root's, 0700) and the listening
// sockets of QMP and the agent port in it, and returns them as files for
// QEMU, which accepts on them. A killed QEMU's sockets are replaced.
func listenSockets(dir string) ([2]*os.File, error) {
	var out [2]*os.File
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return out, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return out, err
	}
	for i, name := range []string{QMPSocket, AgentSocket} {
		p := filepath.Join(dir, name)
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return out, err
		}
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
		if err != nil {
			return out, err
		}
		l.SetUnlinkOnClose(false)
		out[i], err = l.File()
		l.Close()
		if err != nil {
			return out, err
		}
	}
	return out, nil
}
