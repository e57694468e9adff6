package oci

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/template"
)

// cage writes the OCI bundle itself (its own minimal types of the runtime
// spec's config.json; only what cage sets).

type ociSpec struct {
	Version  string   `json:"ociVersion"`
	Process  ociProc  `json:"process"`
	Root     ociRoot  `json:"root"`
	Hostname string   `json:"hostname"`
	Mounts   []ociMnt `json:"mounts"`
	Linux    ociLinux `json:"linux"`
}

type ociProc struct {
	Terminal        bool      `json:"terminal"`
	User            ociUser   `json:"user"`
	Args            []string  `json:"args"`
	Env             []string  `json:"env"`
	Cwd             string    `json:"cwd"`
	Capabilities    ociCaps   `json:"capabilities"`
	Rlimits         []ociRlim `json:"rlimits"`
	NoNewPrivileges bool      `json:"noNewPrivileges"`
}

type ociUser struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

type ociCaps struct {
	Bounding    []string `json:"bounding"`
	Effective   []string `json:"effective"`
	Permitted   []string `json:"permitted"`
	Inheritable []string `json:"inheritable"`
}

type ociRlim struct {
	Type string `json:"type"`
	Hard uint64 `json:"hard"`
	Soft uint64 `json:"soft"`
}

type ociRoot struct {
	Path     string `json:"path"`
	Readonly bool   `json:"readonly"`
}

type ociMnt struct {
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Source      string   `json:"source"`
	Options     []string `json:"options,omitempty"`
}

type ociLinux struct {
	UIDMappings   []ociIDMap    `json:"uidMappings,omitempty"`
	GIDMappings   []ociIDMap    `json:"gidMappings,omitempty"`
	Namespaces    []ociNS       `json:"namespaces"`
	CgroupsPath   string        `json:"cgroupsPath,omitempty"`
	Resources     *ociResources `json:"resources,omitempty"`
	MaskedPaths   []string      `json:"maskedPaths"`
	ReadonlyPaths []string      `json:"readonlyPaths"`
}

type ociIDMap struct {
	ContainerID uint32 `json:"containerID"`
	HostID      uint32 `json:"hostID"`
	Size        uint32 `json:"size"`
}

type ociNS struct {
	Type string `json:"type"`
	Path string `json:"path,omitempty"`
}

type ociResources struct {
	Memory *ociMemory `json:"memory,omitempty"`
	CPU    *ociCPU    `json:"cpu,omitempty"`
	Pids   *ociPids   `json:"pids,omitempty"`
}

type ociMemory struct {
	Limit int64 `json:"limit"`
	Swap  int64 `json:"swap"`
}

type ociCPU struct {
	Quota  int64  `json:"quota"`
	Period uint64 `json:"period"`
}

type ociPids struct {
	Limit int64 `json:"limit"`
}

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
	cgroupPath string
	limits     cgroups.Limits
	shmBytes   int64
	userns     bool
	args       []string // the container's process: the agent, or a bare command (RunBare)
	netns      string   // a network namespace to join ("" = a new one, loopback only)
	resolvConf string
	image      bool // rootfs is an image template's overlay, writable
}

// hostRoot fills the sandbox's own root tmpfs for the host template: the
// template's read-only binds and the directories the container mounts on.
func (b *bundleConfig) hostRoot() ([]ociMnt, error) {
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
		resolvConf = template.NoNetworkResolvConf
	}
	if err := template.WriteIdentity(filepath.Join(rootfs, "run", "cage"), b.hostname, resolvConf); err != nil {
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
	var mounts []ociMnt
	for _, m := range b.template.Mounts {
		switch m.Kind {
		case template.Symlink:
			if err := os.Symlink(m.Target, filepath.Join(rootfs, m.Dest)); err != nil && !os.IsExist(err) {
				return nil, err
			}
		case template.Dir, template.File:
			mounts = append(mounts, ociMnt{Destination: m.Dest, Type: "bind", Source: m.Source,
				Options: []string{"rbind", "ro", "nosuid", "nodev"}})
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
	if err := template.PrepareImageRoot(b.rootfs, b.hostname, hostID, b.template.Build); err != nil {
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

func (b *bundleConfig) write() error {
	var mounts []ociMnt
	var err error
	if b.image {
		err = b.imageRoot()
	} else {
		mounts, err = b.hostRoot()
	}
	if err != nil {
		return err
	}
	shm := fmt.Sprintf("size=%d", b.shmBytes)
	mounts = append(mounts,
		ociMnt{"/proc", "proc", "proc", []string{"nosuid", "noexec", "nodev"}},
		ociMnt{"/dev", "tmpfs", "tmpfs", []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		ociMnt{"/dev/pts", "devpts", "devpts", []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
		ociMnt{"/dev/shm", "tmpfs", "shm", []string{"nosuid", "noexec", "nodev", "mode=1777", shm}},
	)
	if !b.image {
		mounts = append(mounts,
			ociMnt{"/tmp", "bind", filepath.Join(b.disk, "tmp"), []string{"rbind", "rw", "nosuid", "nodev"}},
			ociMnt{"/var/tmp", "bind", filepath.Join(b.disk, "vartmp"), []string{"rbind", "rw", "nosuid", "nodev"}},
			ociMnt{"/home", "bind", filepath.Join(b.disk, "home"), []string{"rbind", "rw", "nosuid", "nodev"}},
			ociMnt{"/root", "bind", filepath.Join(b.disk, "root"), []string{"rbind", "rw", "nosuid", "nodev"}})
	}
	mounts = append(mounts, ociMnt{agentInside, "bind", b.agentPath, []string{"bind", "ro", "nosuid", "nodev"}})
	if b.sockDir != "" {
		// Read-only: the host's channel socket (see gvisor.go).
		mounts = append(mounts, ociMnt{sockInside, "bind", b.sockDir, []string{"rbind", "ro", "nosuid", "nodev", "noexec"}})
	}
	// Open files: 65536, or the host's own hard limit if lower (a runtime
	// cannot raise it).
	nofile := uint64(65536)
	var rl syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil && rl.Max < nofile {
		nofile = rl.Max
	}
	spec := ociSpec{
		Version: "1.0.2",
		Process: ociProc{
			User: ociUser{0, 0}, Args: b.args, Cwd: "/",
			Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			Capabilities: ociCaps{Bounding: containerCaps, Effective: containerCaps, Permitted: containerCaps,
				Inheritable: []string{}},
			Rlimits:         []ociRlim{{"RLIMIT_NOFILE", nofile, nofile}},
			NoNewPrivileges: true,
		},
		Root:     ociRoot{Path: b.rootfs, Readonly: !b.image},
		Hostname: b.hostname,
		Mounts:   mounts,
		Linux: ociLinux{
			Namespaces:  []ociNS{{Type: "pid"}, {Type: "network"}, {Type: "ipc"}, {Type: "uts"}, {Type: "mount"}, {Type: "cgroup"}},
			CgroupsPath: b.cgroupPath, MaskedPaths: maskedPaths, ReadonlyPaths: readonlyPaths,
			Resources: resources(b.limits),
		},
	}
	if b.netns != "" {
		for i := range spec.Linux.Namespaces {
			if spec.Linux.Namespaces[i].Type == "network" {
				spec.Linux.Namespaces[i].Path = b.netns
			}
		}
	}
	if b.userns {
		spec.Linux.Namespaces = append(spec.Linux.Namespaces, ociNS{Type: "user"})
		m := []ociIDMap{{0, b.idBase, 65536}}
		spec.Linux.UIDMappings, spec.Linux.GIDMappings = m, m
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(b.dir, "config.json"), data, 0o600)
}

func resources(l cgroups.Limits) *ociResources {
	r := &ociResources{}
	if l.MemoryBytes > 0 {
		r.Memory = &ociMemory{Limit: l.MemoryBytes, Swap: l.MemoryBytes}
	}
	if l.CPUs > 0 {
		r.CPU = &ociCPU{Quota: int64(l.CPUs * 100000), Period: 100000}
	}
	if l.Pids > 0 {
		r.Pids = &ociPids{Limit: l.Pids}
	}
	return r
}
