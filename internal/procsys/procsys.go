// Package procsys writes sysctls of the calling thread's namespaces
// through a procfs made for the write. Through a procfs that lives on
// (the host's /proc), each network namespace that looks under /proc/sys
// leaves a /proc/sys/net entry, all of one name under one parent, and
// every later lookup of /proc/sys/net walks them all: as many as the
// sandboxes alive, each compared under the kernel's sysctl lock. A leaf:
// the host's network code and the walls' inside halves both use it.
package procsys

import (
	"os"

	"golang.org/x/sys/unix"
)

// Write writes value to the sysctl rel (a path under /proc/sys, such as
// "net/core/optmem_max") as the calling thread's namespaces see it,
// through a procfs of its own that goes when the write is done. Where no
// procfs can be made (an older kernel, or one not allowed here), the path
// is written through /proc.
func Write(rel, value string) error {
	mfd, err := ownProc()
	if err != nil {
		return os.WriteFile("/proc/sys/"+rel, []byte(value), 0)
	}
	defer unix.Close(mfd)
	fd, err := unix.Openat(mfd, "sys/"+rel, unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: "/proc/sys/" + rel, Err: err}
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(value)); err != nil {
		return &os.PathError{Op: "write", Path: "/proc/sys/" + rel, Err: err}
	}
	return nil
}

// ownProc makes a detached procfs mount and returns its descriptor.
func ownProc() (int, error) {
	fsfd, err := unix.Fsopen("proc", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, err
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, err
	}
	return unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
}
