package oci

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/template"
)

// These tests pin the bundle cage hands runc and runsc: what config.json
// says, read back with the runtime spec's own types, and what the root
// holds before the runtime starts.

const (
	testID     = "0123abcd4567ef89"
	testIDBase = 300000
	testShm    = 64 << 20
	testUserNS = "/proc/4242/fd/7" // the user namespace cage made (ownedUserNS)
)

// newBundle fills a bundleConfig as Create does for the wall ("runc" or
// "gvisor"), with a network namespace when netns is set.
func newBundle(t *testing.T, wall string, tmpl *template.Template, netns string) *bundleConfig {
	t.Helper()
	rt := &Runtime{Wall: wall}
	dir := t.TempDir()
	b := &bundleConfig{dir: filepath.Join(dir, "bundle"), rootfs: filepath.Join(dir, "rootfs"), id: testID,
		hostname: "cage-0123abcd", agentPath: "/run/cage/agents/agent-1-2-3/cage-agent", template: tmpl,
		disk: filepath.Join(dir, "disk"), cgroupPath: cgroupsPath(&cgroups.Manager{Parent: "cage"}, testID),
		shmBytes: testShm, idBase: testIDBase, userns: !rt.gvisor(), args: []string{agentInside, "serve"},
		netns: netns, image: tmpl.Image != nil}
	if b.userns {
		b.usernsPath = testUserNS
		if !b.image {
			b.layers = filepath.Join(dir, layersDir)
		}
	}
	if netns != "" {
		b.resolvConf = "nameserver 10.200.0.1\n"
	}
	if rt.gvisor() {
		b.sockDir = filepath.Join(dir, chanDir)
	}
	for _, d := range []string{b.dir, b.rootfs} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// writeBundle writes the bundle and reads config.json back with the
// runtime spec's types.
func writeBundle(t *testing.T, b *bundleConfig) *specs.Spec {
	t.Helper()
	if err := b.write(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(b.dir, "config.json")
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("config.json mode %v, want 0600", fi.Mode().Perm())
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	return &spec
}

// hostTemplate is a host template as template.Lookup makes it (read-only
// binds of host directories and files, and symlinks), without the tmpfs
// its /etc is kept on.
func hostTemplate() *template.Template {
	return &template.Template{Name: "host", EtcCache: "/var/cache/cage/templates/host/etc-1", Mounts: []inside.Mount{
		{Kind: inside.Dir, Source: "/usr", Dest: "/usr"},
		{Kind: inside.Symlink, Dest: "/bin", Target: "usr/bin"},
		{Kind: inside.Symlink, Dest: "/lib64", Target: "usr/lib64"},
		{Kind: inside.File, Source: "/usr/share/zoneinfo/UTC", Dest: "/srv/utc"},
		{Kind: inside.Dir, Source: "/var/cache/cage/templates/host/etc-1", Dest: "/etc"},
	}}
}

func TestBundleRunc(t *testing.T) {
	tmpl := hostTemplate()
	b := newBundle(t, "runc", tmpl, "")
	spec := writeBundle(t, b)
	checkCommon(t, b, spec)
	// The user namespace cage made, mapping the container's 0..65535 to
	// the sandbox's range (the maps say so again: runc reads its root's
	// host ids from them); every other namespace new.
	checkNamespaces(t, spec, map[specs.LinuxNamespaceType]string{specs.PIDNamespace: "", specs.NetworkNamespace: "",
		specs.IPCNamespace: "", specs.UTSNamespace: "", specs.MountNamespace: "", specs.CgroupNamespace: "",
		specs.UserNamespace: testUserNS})
	want := []specs.LinuxIDMapping{{ContainerID: 0, HostID: testIDBase, Size: 65536}}
	if !slices.Equal(spec.Linux.UIDMappings, want) || !slices.Equal(spec.Linux.GIDMappings, want) {
		t.Errorf("id maps: uid %+v gid %+v, want %+v", spec.Linux.UIDMappings, spec.Linux.GIDMappings, want)
	}
	checkMounts(t, spec, slices.Concat(templateBinds(t, b), kernelMounts(), diskBinds(b), []specs.Mount{agentMount(b)}))
	checkHostRoot(t, b)
}

func TestBundleGVisor(t *testing.T) {
	tmpl := hostTemplate()
	netns := "/run/cage/sandboxes/" + testID + "/netns"
	b := newBundle(t, "gvisor", tmpl, netns)
	spec := writeBundle(t, b)
	checkCommon(t, b, spec)
	// No user namespace (the sentry serves host ids as they are): no maps.
	// The network namespace is the one made for the sandbox's network.
	checkNamespaces(t, spec, map[specs.LinuxNamespaceType]string{specs.PIDNamespace: "", specs.NetworkNamespace: netns,
		specs.IPCNamespace: "", specs.UTSNamespace: "", specs.MountNamespace: "", specs.CgroupNamespace: ""})
	if spec.Linux.UIDMappings != nil || spec.Linux.GIDMappings != nil {
		t.Errorf("gVisor bundle has id maps: %+v %+v", spec.Linux.UIDMappings, spec.Linux.GIDMappings)
	}
	checkMounts(t, spec, slices.Concat(templateBinds(t, b), kernelMounts(), diskBinds(b), []specs.Mount{agentMount(b), sockMount(b)}))
	checkHostRoot(t, b)
	if fi, err := os.Stat(filepath.Join(b.rootfs, sockInside)); err != nil || !fi.IsDir() {
		t.Errorf("no mount point for the channel's directory: %v", err)
	}
	resolv, err := os.ReadFile(filepath.Join(b.rootfs, "run", "cage", "resolv.conf"))
	if err != nil || string(resolv) != b.resolvConf {
		t.Errorf("resolv.conf %q (%v), want the network's", resolv, err)
	}
}

// TestBundleImage: an image template's overlay is the root, writable; no
// template binds and no disk binds (its storage is in the overlay).
func TestBundleImage(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the image root is chowned to the sandbox's ids: needs root")
	}
	for _, wall := range []string{"runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) {
			b := newBundle(t, wall, &template.Template{Name: "img", Image: &template.Image{}}, "")
			spec := writeBundle(t, b)
			checkCommon(t, b, spec)
			mounts := []specs.Mount{agentMount(b)}
			if wall == "gvisor" {
				mounts = append(mounts, sockMount(b))
			}
			checkMounts(t, spec, append(kernelMounts(), mounts...))
			if fi, err := os.Stat(filepath.Join(b.rootfs, agentInside)); err != nil || !fi.Mode().IsRegular() {
				t.Errorf("no mount point for the agent: %v", err)
			}
			owner := 0
			if wall == "runc" {
				owner = testIDBase // the container's root, through its uid map
			}
			if uid := fileUID(t, filepath.Join(b.rootfs, "root")); uid != owner {
				t.Errorf("/root is uid %d on the host, want %d", uid, owner)
			}
		})
	}
}

// TestBundleBare: RunBare's command replaces the agent; nothing else
// changes.
func TestBundleBare(t *testing.T) {
	b := newBundle(t, "runc", hostTemplate(), "")
	b.args = []string{"/bin/true"}
	spec := writeBundle(t, b)
	checkCommon(t, b, spec)
	checkMounts(t, spec, slices.Concat(templateBinds(t, b), kernelMounts(), diskBinds(b), []specs.Mount{agentMount(b)}))
}

// checkCommon checks what every bundle says alike.
func checkCommon(t *testing.T, b *bundleConfig, spec *specs.Spec) {
	t.Helper()
	if spec.Version != "1.0.2" {
		t.Errorf("ociVersion %q", spec.Version)
	}
	if spec.Hostname != b.hostname {
		t.Errorf("hostname %q, want %q", spec.Hostname, b.hostname)
	}
	if spec.Root == nil || spec.Root.Path != b.rootfs || spec.Root.Readonly != !b.image {
		t.Errorf("root %+v, want %s read-only %v", spec.Root, b.rootfs, !b.image)
	}
	checkProcess(t, spec.Process, b.args, !b.userns)
	l := spec.Linux
	if l == nil {
		t.Fatal("no linux section")
	}
	if l.CgroupsPath != "/cage/"+testID {
		t.Errorf("cgroupsPath %q", l.CgroupsPath)
	}
	// The limits are cage's group's alone (see linux).
	if l.Resources != nil {
		t.Errorf("linux.resources set: %+v", l.Resources)
	}
	masked := []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug",
		"/proc/latency_stats", "/proc/kallsyms", "/proc/acpi", "/proc/scsi", "/proc/asound",
		"/proc/firmware", "/proc/interrupts", "/proc/kpagecount", "/proc/kpageflags",
		"/proc/kpagecgroup", "/proc/vmallocinfo", "/sys/firmware"}
	if !slices.Equal(l.MaskedPaths, masked) {
		t.Errorf("masked paths %q, want %q", l.MaskedPaths, masked)
	}
	readonly := []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
	if !slices.Equal(l.ReadonlyPaths, readonly) {
		t.Errorf("read-only paths %q, want %q", l.ReadonlyPaths, readonly)
	}
	// Under runc, whose sockets are the host kernel's, what they keep of
	// the host's memory outside the sandbox's cgroup: option memory
	// (inside.OptMemMax) and connections in TIME_WAIT
	// (inside.MaxTimeWait); none under gVisor.
	wantSysctl := map[string]string(nil)
	if b.userns {
		wantSysctl = map[string]string{"net.core.optmem_max": "20480", "net.ipv4.tcp_max_tw_buckets": "4096"}
	}
	if !maps.Equal(l.Sysctl, wantSysctl) {
		t.Errorf("sysctl %v, want %v", l.Sysctl, wantSysctl)
	}
	// Nothing else cage does not set: no hooks, devices, seccomp of the
	// runtime's (the agent installs its own), no annotations.
	if spec.Hooks != nil || spec.Annotations != nil || l.Devices != nil || l.Seccomp != nil {
		t.Errorf("unexpected settings: hooks %+v annotations %v devices %v seccomp %v",
			spec.Hooks, spec.Annotations, l.Devices, l.Seccomp)
	}
}

// checkProcess: root, PATH, cwd /, the agent's capabilities (no more), no
// inheritable or ambient ones, no_new_privs, and the open files limit
// where the runtime sets it (nofile; runc's agent sets its own).
func checkProcess(t *testing.T, p *specs.Process, args []string, nofile bool) {
	t.Helper()
	if p == nil {
		t.Fatal("no process")
	}
	if p.User.UID != 0 || p.User.GID != 0 || p.User.AdditionalGids != nil || p.Terminal {
		t.Errorf("user %+v terminal %v", p.User, p.Terminal)
	}
	if !slices.Equal(p.Args, args) || p.Cwd != "/" {
		t.Errorf("args %q cwd %q", p.Args, p.Cwd)
	}
	env := []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if !slices.Equal(p.Env, env) {
		t.Errorf("env %q", p.Env)
	}
	if !p.NoNewPrivileges {
		t.Error("no_new_privs is off")
	}
	caps := []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
		"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_ADMIN"}
	c := p.Capabilities
	if c == nil || !slices.Equal(c.Bounding, caps) || !slices.Equal(c.Effective, caps) ||
		!slices.Equal(c.Permitted, caps) || len(c.Inheritable) != 0 || len(c.Ambient) != 0 {
		t.Errorf("capabilities %+v, want %q bounding, effective and permitted only", c, caps)
	}
	if !nofile {
		if len(p.Rlimits) != 0 {
			t.Errorf("rlimits %+v, want none", p.Rlimits)
		}
		return
	}
	if len(p.Rlimits) != 1 {
		t.Fatalf("rlimits %+v, want RLIMIT_NOFILE only", p.Rlimits)
	}
	r := p.Rlimits[0]
	if r.Type != "RLIMIT_NOFILE" || r.Soft != r.Hard || r.Hard == 0 || r.Hard > 65536 {
		t.Errorf("rlimit %+v, want RLIMIT_NOFILE at 65536 or the host's hard limit", r)
	}
}

// checkNamespaces wants exactly the namespaces in want, with their paths.
func checkNamespaces(t *testing.T, spec *specs.Spec, want map[specs.LinuxNamespaceType]string) {
	t.Helper()
	got := map[specs.LinuxNamespaceType]string{}
	for _, ns := range spec.Linux.Namespaces {
		if _, dup := got[ns.Type]; dup {
			t.Errorf("namespace %s twice", ns.Type)
		}
		got[ns.Type] = ns.Path
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("namespaces %v, want %v", got, want)
	}
}

// checkMounts wants exactly these mounts, in this order.
func checkMounts(t *testing.T, spec *specs.Spec, want []specs.Mount) {
	t.Helper()
	if len(spec.Mounts) != len(want) {
		t.Errorf("%d mounts, want %d", len(spec.Mounts), len(want))
	}
	for i := range max(len(spec.Mounts), len(want)) {
		var g, w specs.Mount
		if i < len(spec.Mounts) {
			g = spec.Mounts[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if fmt.Sprintf("%+v", g) != fmt.Sprintf("%+v", w) {
			t.Errorf("mount %d: %+v, want %+v", i, g, w)
		}
	}
}

// templateBinds are the host template's read-only binds, in its order;
// its symlinks are made in the root instead. Under runc a directory's
// bind is of its mount point in the layers directory, where runc's mount
// namespace has its overlay (see layers.go); under gVisor, of the host's.
func templateBinds(t *testing.T, b *bundleConfig) []specs.Mount {
	t.Helper()
	var out []specs.Mount
	for i, m := range b.template.Mounts {
		if m.Kind == inside.Symlink {
			continue // made in the root (see checkHostRoot)
		}
		src := m.Source
		if m.Kind == inside.Dir && b.userns {
			src = filepath.Join(b.layers, strconv.Itoa(i))
			if fi, err := os.Stat(src); err != nil || !fi.IsDir() {
				t.Errorf("no mount point for %s's overlay: %v", m.Dest, err)
			}
		}
		out = append(out, specs.Mount{Destination: m.Dest, Type: "bind", Source: src,
			Options: []string{"rbind", "ro", "nosuid", "nodev"}})
	}
	if !slices.ContainsFunc(out, func(m specs.Mount) bool { return m.Destination == "/etc" }) ||
		!slices.ContainsFunc(out, func(m specs.Mount) bool { return m.Destination == "/usr" }) {
		t.Errorf("the host template binds no /etc or /usr: %+v", out)
	}
	return out
}

func kernelMounts() []specs.Mount {
	return []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts",
			Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "max=256"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm",
			Options: []string{"nosuid", "noexec", "nodev", "mode=1777", fmt.Sprintf("size=%d", testShm)}},
	}
}

// diskBinds are the sandbox disk's directories, writable, nosuid, nodev.
func diskBinds(b *bundleConfig) []specs.Mount {
	var out []specs.Mount
	for _, d := range []struct{ dest, dir string }{{"/tmp", "tmp"}, {"/var/tmp", "vartmp"}, {"/home", "home"}, {"/root", "root"}} {
		out = append(out, specs.Mount{Destination: d.dest, Type: "bind", Source: filepath.Join(b.disk, d.dir),
			Options: []string{"rbind", "rw", "nosuid", "nodev"}})
	}
	return out
}

func agentMount(b *bundleConfig) specs.Mount {
	return specs.Mount{Destination: agentInside, Type: "bind", Source: b.agentPath,
		Options: []string{"bind", "ro", "nosuid", "nodev"}}
}

// sockMount is gVisor's channel directory, read-only and noexec.
func sockMount(b *bundleConfig) specs.Mount {
	return specs.Mount{Destination: sockInside, Type: "bind", Source: b.sockDir,
		Options: []string{"rbind", "ro", "nosuid", "nodev", "noexec"}}
}

// checkHostRoot: the host template's root holds its symlinks, the mount
// points, the agent's and the identity files.
func checkHostRoot(t *testing.T, b *bundleConfig) {
	t.Helper()
	for _, m := range b.template.Mounts {
		if m.Kind != inside.Symlink {
			continue
		}
		if target, err := os.Readlink(filepath.Join(b.rootfs, m.Dest)); err != nil || target != m.Target {
			t.Errorf("symlink %s -> %q (%v), want %q", m.Dest, target, err, m.Target)
		}
	}
	for _, d := range []string{"usr", "etc", "tmp", "home", "root", "var/tmp", "proc", "dev", "run"} {
		if fi, err := os.Stat(filepath.Join(b.rootfs, d)); err != nil || !fi.IsDir() {
			t.Errorf("no mount point /%s: %v", d, err)
		}
	}
	if fi, err := os.Stat(filepath.Join(b.rootfs, agentInside)); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("no mount point for the agent: %v", err)
	}
	if _, err := os.Stat(filepath.Join(b.rootfs, "run", "cage", "hostname")); err != nil {
		t.Errorf("no identity files: %v", err)
	}
}

func fileUID(t *testing.T, path string) int {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return int(fi.Sys().(*syscall.Stat_t).Uid)
}

// TestBundleImageVolumeNoSymlink: an image's symlink never leads a
// volume's mount point elsewhere: with /mnt -> / in the image, a volume at
// /mnt/dev (lexically no system tree) would have runc bind the volume,
// which other sandboxes write, over the container's /dev, where runc makes
// the /dev/null it masks /proc's files with (CVE-2025-31133's setting).
// The create fails instead, as on the process wall; a volume's missing
// mount point is made a real directory, the sandbox root's.
func TestBundleImageVolumeNoSymlink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the image root is chowned to the sandbox's ids: needs root")
	}
	for _, wall := range []string{"runc", "gvisor"} {
		t.Run(wall, func(t *testing.T) {
			for _, link := range []struct{ name, target, vol string }{
				{"mnt", "/", "/mnt/dev"}, {"mnt", "/proc", "/mnt/sys"}, {"data", "mnt", "/data/x"},
			} {
				b := newBundle(t, wall, &template.Template{Name: "img", Image: &template.Image{}}, "")
				if err := os.Symlink(link.target, filepath.Join(b.rootfs, link.name)); err != nil {
					t.Fatal(err)
				}
				b.volumes = []specs.Mount{bind(link.vol, t.TempDir(), "rbind", "rw", "nosuid", "nodev")}
				if err := b.write(); err == nil {
					t.Errorf("/%s -> %s, a volume at %s: the bundle was written, want an error", link.name, link.target, link.vol)
				} else {
					t.Logf("/%s -> %s, a volume at %s: %v", link.name, link.target, link.vol, err)
				}
			}
			b := newBundle(t, wall, &template.Template{Name: "img", Image: &template.Image{}}, "")
			b.volumes = []specs.Mount{bind("/data/deep/vol", t.TempDir(), "rbind", "rw", "nosuid", "nodev")}
			writeBundle(t, b)
			owner := 0
			if wall == "runc" {
				owner = testIDBase
			}
			for _, p := range []string{"data", "data/deep", "data/deep/vol"} {
				fi, err := os.Lstat(filepath.Join(b.rootfs, p))
				if err != nil || !fi.IsDir() {
					t.Fatalf("/%s: %v, want a directory", p, err)
				}
				if uid := fileUID(t, filepath.Join(b.rootfs, p)); uid != owner {
					t.Errorf("/%s is uid %d on the host, want %d", p, uid, owner)
				}
			}
		})
	}
}
