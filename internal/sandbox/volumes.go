package sandbox

import (
	"fmt"
	"path"
	"strings"

	"github.com/cagehq/cage/internal/wall"
)

// Where a volume may be mounted in a sandbox: an absolute path of at most
// 1024 bytes that is not the root, not a directory the sandbox's own files
// or cage's live in (the disk's /tmp, /var/tmp, /home and /root, whose
// subdirectories are fine), and not in a system tree (/proc, /sys, /dev,
// /run, /etc, /usr, /bin, /sbin, /lib*, /boot) where the host template is
// read-only and cage keeps its own mounts. Two volumes may not share a
// path or nest.
var (
	volumeSystemTrees = []string{"/proc", "/sys", "/dev", "/run", "/etc", "/usr", "/bin", "/sbin",
		"/lib", "/lib32", "/lib64", "/libx32", "/boot"}
	volumeNotOn = []string{"/tmp", "/var/tmp", "/var", "/home", "/root"}
)

// CheckVolumePath checks where a volume is to be mounted and returns the
// path clean.
func CheckVolumePath(p string) (string, error) {
	switch {
	case p == "" || !path.IsAbs(p):
		return "", fmt.Errorf("%w: volume mount path %q: want an absolute path", ErrInvalid, p)
	case len(p) > 1024 || strings.ContainsRune(p, 0):
		return "", fmt.Errorf("%w: volume mount path %.64q: too long or holds a NUL byte", ErrInvalid, p)
	}
	c := path.Clean(p)
	if c == "/" {
		return "", fmt.Errorf("%w: a volume cannot be mounted on /", ErrInvalid)
	}
	for _, t := range volumeSystemTrees {
		if c == t || strings.HasPrefix(c, t+"/") {
			return "", fmt.Errorf("%w: volume mount path %s is in %s, which is the system's or cage's; use /mnt/NAME, /data, /home/user/NAME, say", ErrInvalid, c, t)
		}
	}
	for _, t := range volumeNotOn {
		if c == t {
			return "", fmt.Errorf("%w: a volume cannot be mounted on %s itself (the sandbox's disk); use a directory under it", ErrInvalid, c)
		}
	}
	return c, nil
}

// checkVolumes checks the mounts of o: each path, none on or in another.
func checkVolumes(vs []wall.Volume) error {
	for i, v := range vs {
		c, err := CheckVolumePath(v.Path)
		if err != nil {
			return err
		}
		if v.Root == nil {
			return fmt.Errorf("%w: volume at %s: not open", ErrInvalid, c)
		}
		vs[i].Path = c
		for _, w := range vs[:i] {
			if w.Path == c || strings.HasPrefix(c, w.Path+"/") || strings.HasPrefix(w.Path, c+"/") {
				return fmt.Errorf("%w: volumes at %s and %s: two volumes may not share a path or nest", ErrInvalid, w.Path, c)
			}
		}
	}
	return nil
}

// volumesOn refuses volumes on a wall whose driver cannot mount them.
func volumesOn(d wall.Driver, vs []wall.Volume) error {
	if len(vs) == 0 {
		return nil
	}
	vm, ok := d.(wall.VolumeMounter)
	if !ok {
		return fmt.Errorf("%w: the %s wall cannot mount volumes", ErrInvalid, d.Name())
	}
	return vm.VolumesMissing()
}
