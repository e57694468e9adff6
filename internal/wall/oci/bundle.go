package oci

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/template"
)

// cage writes the OCI bundle's config.json itself, with the runtime
// spec's own Go types, setting only what cage needs.

// ociVersion is the version of the runtime spec the bundle claims: the
// oldest that names everything cage sets, which every runtime cage runs
// (runc 1.1, runsc) reads.
const ociVersion = "1.0.2"

// The agent's capabilities in the container: what it keeps for good, plus
// CAP_SETPCAP (to shrink its spawning thread's bounding set and set its
// securebits) and CAP_NET_ADMIN (to bring the loopback up); it drops both
// when it seals.
var containerCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_ADMIN",
}

// Paths of /proc the runtime masks or makes read-only (as the process wall).
var (
	maskedPaths = []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
		"/proc/latency_stats", "/proc/kallsyms", "/proc/acpi", "/proc/scsi", "/proc/asound",
		"/proc/firmware", "/proc/interrupts", "/proc/kpagecount", "/proc/kpageflags",
		"/proc/kpagecgroup", "/proc/vmallocinfo", "/sys/firmware"}
	readonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)

// Where the agent and (under gVisor) the channel's directory are inside.
const (
	agentInside = "/run/cage-agent"
	sockInside  = "/run/cage-sock"
)

// bundleConfig is what a bundle needs.
type bundleConfig struct {
	dir        string // the bundle directory (config.json)
	rootfs     string // the sandbox's root: an empty tmpfs of its own on the host
	id         string
	hostname   string
	agentPath  string // host path of the agent's read-only copy (see agentCopy)
	template   *template.Template
	disk       string // host directory holding the disk's tmp, vartmp, home, root
	sockDir    string // host directory of the channel's socket, bound read-only ("" = none)
	idBase     uint32 // host uid/gid of the container's 0, or 0 for no user namespace
	cgroupPath string // the group cage made and limited (see linux)
	shmBytes   int64
	userns     bool
	usernsPath string   // the user namespace to join, made by cage (see ownedUserNS)
	args       []string // the container's process: the agent, or a bare command (RunBare)
	netns      string   // a network namespace to join ("" = a new one, loopback only)
	resolvConf string
	image      bool          // rootfs is an image template's overlay, writable
	layers     string        // the host template under runc: its directories' mount points (see layers.go)
	volumes    []specs.Mount // binds of the volumes' copies (see volumes.go)
}

// hostRoot fills the sandbox's own root tmpfs for the host template: the
// template's read-only binds and the directories the container mounts on.
// Under runc a directory's bind is of its overlay, mounted on its mount
// point in b.layers as runc starts (see layers.go); under gVisor, of the
// host's.
func (b *bundleConfig) hostRoot() ([]specs.Mount, error) {
	rootfs := b.rootfs
	dirs := []string{"usr", "etc", "tmp", "home", "root", "var/tmp", "proc", "dev", "run", "mnt", "opt", "srv"}
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			return nil, err
		}
	}
	// The files that name the sandbox, and the mount point of the agent.
	resolvConf := b.resolvConf
	if resolvConf == "" {
		resolvConf = inside.NoNetworkResolvConf
	}
	if err := inside.WriteIdentity(filepath.Join(rootfs, "run", "cage"), b.hostname, resolvConf); err != nil {
		return nil, err
	}
	if f, err := os.OpenFile(filepath.Join(rootfs, agentInside), os.O_CREATE|os.O_WRONLY, 0o755); err == nil {
		f.Close()
	} else {
		return nil, err
	}
	if b.sockDir != "" {
		if err := os.MkdirAll(filepath.Join(rootfs, sockInside), 0o755); err != nil {
			return nil, err
		}
	}
	// The volumes' mount points: the root is the host's tmpfs, where the
	// container's root (under runc, an unprivileged uid) cannot make them.
	// (Under /home and the other disk binds the runtime makes them in the
	// disk, which is the container's.)
	for _, v := range b.volumes {
		if err := os.MkdirAll(filepath.Join(rootfs, v.Destination), 0o755); err != nil {
			return nil, err
		}
	}
	if b.layers != "" {
		if err := makeLayerPoints(b.layers, b.template.Mounts); err != nil {
			return nil, err
		}
	}
	var mounts []specs.Mount
	for i, m := range b.template.Mounts {
		switch m.Kind {
		case inside.Symlink:
			if err := os.Symlink(m.Target, filepath.Join(rootfs, m.Dest)); err != nil && !os.IsExist(err) {
				return nil, err
			}
		case inside.Dir, inside.File:
			src := m.Source
			if m.Kind == inside.Dir && b.layers != "" {
				src = layerPath(b.layers, i)
			}
			mounts = append(mounts, bind(m.Dest, src, "rbind", "ro", "nosuid", "nodev"))
		}
	}
	return mounts, nil
}

// imageRoot prepares an image template's overlay: cage's directories,
// accounts and identity files, written as the sandbox's root would own
// them, every path resolved inside the root (the image is not trusted).
func (b *bundleConfig) imageRoot() error {
	hostID := func(id int) int { return id }
	if b.userns {
		hostID = func(id int) int { return int(b.idBase) + id }
	}
	if err := inside.PrepareImageRoot(b.rootfs, b.hostname, hostID, b.template.Build); err != nil {
		return err
	}
	r, err := os.OpenRoot(b.rootfs)
	if err != nil {
		return err
	}
	defer r.Close()
	if b.resolvConf != "" {
		if err := r.WriteFile("run/cage/resolv.conf", []byte(b.resolvConf), 0o644); err != nil {
			return err
		}
	}
	// The volumes' mount points, made here so that the runtime follows
	// no link of the image's to them (see volumePoint).
	for _, v := range b.volumes {
		if err := volumePoint(b.rootfs, v.Destination, hostID(0)); err != nil {
			return fmt.Errorf("volume at %s: %w", v.Destination, err)
		}
	}
	// Mount points of the agent and its socket directory.
	_ = r.RemoveAll(agentInside[1:])
	if err := r.WriteFile(agentInside[1:], nil, 0o755); err != nil {
		return err
	}
	if b.sockDir != "" {
		_ = r.RemoveAll(sockInside[1:])
		if err := r.Mkdir(sockInside[1:], 0o755); err != nil {
			return err
		}
	}
	return nil
}

// volumePoint makes the directory p under an image's root, and what is
// missing above it (0755, the sandbox root's), following no symlink: a
// component that is one (or not a directory) fails the create, as on the
// process wall. runc resolves a mount's destination in the root and
// follows the image's symlinks there; an image with /mnt -> / and a
// volume at /mnt/dev (lexically no system tree) had runc bind the volume,
// whose content other running sandboxes write, over the container's /dev,
// then make its device nodes there and mask /proc's files with that
// /dev/null: runc before 1.2.8 opened whatever another sandbox left as
// null (CVE-2025-31133's setting; here the sandbox's user namespace made
// its open of core_pattern fail, permission denied). /proc and /dev are
// the image root's real directories (inside.PrepareImageRoot).
func volumePoint(root, p string, owner int) error {
	cur, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer func() { unix.Close(cur) }()
	for _, c := range strings.Split(strings.Trim(p, "/"), "/") {
		if c == "" || c == "." || c == ".." {
			return fmt.Errorf("component %q", c)
		}
		switch err := unix.Mkdirat(cur, c, 0o755); {
		case err == nil:
			if err := unix.Fchownat(cur, c, owner, owner, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return err
			}
		case !errors.Is(err, unix.EEXIST):
			return err
		}
		next, err := unix.Openat2(cur, c, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV})
		if err != nil {
			return fmt.Errorf("%s in the image is a symlink or not a directory: %w", c, err)
		}
		unix.Close(cur)
		cur = next
	}
	return nil
}

// write prepares the root and writes config.json.
func (b *bundleConfig) write() error {
	var mounts []specs.Mount
	var err error
	if b.image {
		err = b.imageRoot()
	} else {
		mounts, err = b.hostRoot()
	}
	if err != nil {
		return err
	}
	spec := &specs.Spec{
		Version:  ociVersion,
		Process:  b.process(),
		Root:     &specs.Root{Path: b.rootfs, Readonly: !b.image},
		Hostname: b.hostname,
		Mounts:   b.mounts(mounts),
		Linux:    b.linux(),
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(b.dir, "config.json"), data, 0o600)
}

func bind(dest, src string, options ...string) specs.Mount {
	return specs.Mount{Destination: dest, Type: "bind", Source: src, Options: options}
}

// mounts follows the root's own (the host template's binds) with the
// kernel filesystems, the disk's directories (the host template), the
// agent and (gVisor) the channel's directory.
func (b *bundleConfig) mounts(mounts []specs.Mount) []specs.Mount {
	shm := fmt.Sprintf("size=%d", b.shmBytes)
	mounts = append(mounts,
		specs.Mount{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		specs.Mount{Destination: "/dev", Type: "tmpfs", Source: "tmpfs",
			Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		specs.Mount{Destination: "/dev/pts", Type: "devpts", Source: "devpts",
			Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "max=" + strconv.Itoa(inside.MaxPtys)}},
		specs.Mount{Destination: "/dev/shm", Type: "tmpfs", Source: "shm",
			Options: []string{"nosuid", "noexec", "nodev", "mode=1777", shm}},
	)
	if !b.image {
		for _, d := range []struct{ dest, dir string }{{"/tmp", "tmp"}, {"/var/tmp", "vartmp"}, {"/home", "home"}, {"/root", "root"}} {
			mounts = append(mounts, bind(d.dest, filepath.Join(b.disk, d.dir), "rbind", "rw", "nosuid", "nodev"))
		}
	}
	mounts = append(mounts, b.volumes...) // after the disk: a volume may be under /home
	mounts = append(mounts, bind(agentInside, b.agentPath, "bind", "ro", "nosuid", "nodev"))
	if b.sockDir != "" {
		// Read-only: the host's channel socket (see gvisor.go).
		mounts = append(mounts, bind(sockInside, b.sockDir, "rbind", "ro", "nosuid", "nodev", "noexec"))
	}
	return mounts
}

// process is the container's init: root, with containerCaps and
// no_new_privs.
//
// Open files: 65536, or the host's own hard limit if lower (a runtime
// cannot raise it). runsc sets it from the bundle; under runc the agent
// sets it itself (inside.LimitOpenFiles), as runc's prlimit on a process in a
// user namespace that is not host root's needs CAP_SYS_RESOURCE, which
// host root does not always hold (it lacks it in these machines' VMs).
func (b *bundleConfig) process() *specs.Process {
	p := &specs.Process{
		User: specs.User{UID: 0, GID: 0}, Args: b.args, Cwd: "/",
		Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Capabilities: &specs.LinuxCapabilities{Bounding: containerCaps, Effective: containerCaps,
			Permitted: containerCaps},
		NoNewPrivileges: true,
	}
	if !b.userns {
		nofile := uint64(inside.MaxOpenFiles)
		var rl syscall.Rlimit
		if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil && rl.Max < nofile {
			nofile = rl.Max
		}
		p.Rlimits = []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile}}
	}
	return p
}

// linux names the namespaces (the network's joined when the sandbox has
// one; under runc, a user namespace mapped to the sandbox's ids, joined
// where cage made it: see ownedUserNS), the paths masked, and the cgroup.
//
// The bundle names the group cage made (cgroups.Manager.Create, before the
// runtime starts) and sets no linux.resources: cage's group is what limits
// the sandbox. It must exist first, as the agent is handed its OOM and
// pids event files opened on the host (the exit reasons oom and
// pids_limit); it turns swap off as each cgroup version needs (a thing
// linux.resources says differently per runtime); and it is the code every
// wall limits with. runsc, finding the group there, ignores
// linux.resources altogether and sizes the sandbox from the group's own
// files; runc wrote the same values again.
func (b *bundleConfig) linux() *specs.Linux {
	l := &specs.Linux{
		Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace, Path: b.netns},
			{Type: specs.IPCNamespace}, {Type: specs.UTSNamespace}, {Type: specs.MountNamespace},
			{Type: specs.CgroupNamespace}},
		CgroupsPath: b.cgroupPath, MaskedPaths: maskedPaths, ReadonlyPaths: readonlyPaths,
	}
	if b.userns {
		l.Namespaces = append(l.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace, Path: b.usernsPath})
		m := []specs.LinuxIDMapping{{ContainerID: 0, HostID: b.idBase, Size: 65536}}
		l.UIDMappings, l.GIDMappings = m, m
		// runc, whose sockets are the host kernel's: what they keep of
		// the host's memory outside the sandbox's cgroup (option memory,
		// connections in TIME_WAIT), bounded as the process wall bounds
		// it (inside.NetSysctls; gVisor's sockets are its sentry's).
		l.Sysctl = maps.Clone(inside.NetSysctls)
	}
	return l
}
