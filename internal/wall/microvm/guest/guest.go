package guest

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"github.com/hashicorp/yamux"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/seal"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/vm/boot"
	"github.com/cagehq/cage/internal/wall/channel"
)

// guestAgent is the agent in the guest: PID 1 of the sandbox's PID
// namespace, on the agent port its init opened. It returns only on error
// (the guest is then powered off).
func guestAgent(port *os.File) error {
	// Open files as on every other wall, soft and hard alike: the guest's
	// kernel starts its processes at 1024 (hard 4096), and its root may
	// raise them. To inside.MaxOpenFiles, or half the guest's own
	// fs.file-max where that is less (it follows the guest's RAM: some
	// 58,000 in 256 MiB), so that one process meets EMFILE before the
	// guest runs out. syscall's Setrlimit (see inside.LimitOpenFiles).
	n := guestOpenFiles()
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: n, Max: n}); err != nil {
		return fmt.Errorf("open files limit: %w", err)
	}
	// No core dumps, as on every wall (the guest's core_pattern is the
	// guest's own; the limit is the same so that commands see one).
	if err := inside.LimitCoreDumps(); err != nil {
		return err
	}
	var disk *os.File   // the root's upper layer, once mounted
	var made *madeAgent // the agent, made before a snapshot
	for {
		conn, err := dupPort(port)
		if err != nil {
			return err
		}
		sess, first, sp, err := nextHost(conn)
		if err != nil {
			return err
		}
		restored := disk != nil
		if restored {
			err = resizeDisk(disk, sp.DiskBytes, sp.ShmBytes)
		} else {
			disk, err = switchRoot(sp)
		}
		if err != nil {
			fmt.Fprintf(first, "error: %v\n", err)
			return err
		}
		if !sp.Prepare {
			return serve(sess, first, sp, made, port, disk)
		}
		if err := warmUp(); err != nil {
			fmt.Fprintf(first, "error: %v\n", err)
			return err
		}
		// The agent too: every restored guest would make the same one
		// (nothing of it is a sandbox's until Configure), and under TCG
		// making it after the restore costs a good part of the create.
		if made == nil {
			if made, err = makeAgent(sp.Threads); err != nil {
				fmt.Fprintf(first, "error: %v\n", err)
				return err
			}
			// And the protobuf tables of a first command, which every
			// restored guest shares with the snapshot's pages.
			agent.WarmProtocol()
		}
		// A snapshot is made of this guest: answer, wait for the host to
		// go (the port's EOF ends the session), and wait for the next one
		// as a fresh guest does. A hello written while the preparing host
		// still held the port would reach it, not the next host.
		// No error is ours to act on here: the host leaves as soon as it
		// has read the answer, and the write can see the session end
		// before it sees its own completion. A host that got no answer
		// gives up on the snapshot and leaves too. Nothing more is
		// written: not even the stream's close (a yamux frame), which
		// could reach the port after the host has left, stay queued in
		// the snapshot and come before the hello every restored guest
		// writes.
		_, _ = io.WriteString(first, Prepared)
		<-sess.CloseChan()
		sess.Close() // and its descriptor of the port
		port.Close()
		if port, err = boot.ReopenAgentPort(); err != nil {
			return err
		}
	}
}

// guestOpenFiles is the guest's limit of open files per process (see
// guestAgent).
func guestOpenFiles() uint64 {
	n := uint64(inside.MaxOpenFiles)
	if b, err := os.ReadFile("/proc/sys/fs/file-max"); err == nil {
		if fileMax, err := strconv.ParseUint(string(bytes.TrimSpace(b)), 10, 64); err == nil && fileMax/2 < n {
			n = max(fileMax/2, 1024)
		}
	}
	return n
}

// writeNames puts the hostname into /run/cage/hostname and hosts, which
// inside.PrepareImageRoot made when the root was mounted for a snapshot,
// without the name. The same content, written in place: a restored guest
// runs every code path for the first time, slowly under TCG, and these
// few writes cost less than preparing the root again.
func writeNames(hostname string) error {
	for name, content := range map[string]string{"/run/cage/hosts": inside.HostsFile(hostname), "/run/cage/hostname": hostname + "\n"} {
		if err := os.WriteFile(name, []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// warmUp does, while a snapshot is made, what every sandbox needs and
// holds nothing of its own, so that no restored guest pays for it (under
// TCG a restored guest runs slowly what it runs for the first time, and
// its reads from the image are the slowest of all): the loopback interface
// and, in the page cache, the image's files that the agent and a first
// command read (warmFiles). Not the agent's threads: they cost less to
// make after the restore than the sealing of each costs (seal.Seal touches
// every thread).
func warmUp() error {
	if err := inside.LoopbackUp(); err != nil {
		return err
	}
	for _, p := range warmFiles {
		warmFile(p)
	}
	return nil
}

// warmFiles are what the agent reads as it starts (the accounts) and what
// a first command runs (E2B's commands go through bash -l -c; a command
// needs the dynamic loader and libc), where the image has them.
var warmFiles = []string{"/bin/sh", "/bin/bash", "/etc/passwd", "/etc/group", "/etc/profile", "/etc/bash.bashrc",
	"/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libtinfo.so.6",
	"/usr/bin/env", "/usr/bin/echo", "/usr/bin/true"}

// warmFile reads a file of the image into the page cache, which the
// snapshot keeps.
func warmFile(p string) {
	f, err := os.Open(p)
	if err != nil {
		return // not in this image
	}
	defer f.Close()
	_, _ = io.Copy(io.Discard, f)
}

// dupPort is a descriptor of its own of the port, for one session.
func dupPort(port *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(port.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("agent port: %w", err)
	}
	return os.NewFile(uintptr(fd), "agent-port"), nil
}

// nextHost greets the host that connects to the port next and reads its
// spec from the session's first stream.
func nextHost(port io.ReadWriteCloser) (*yamux.Session, net.Conn, Spec, error) {
	var sp Spec
	// Blocks until a host holds the port's other end; a snapshot's guest
	// is saved blocked here.
	if _, err := io.WriteString(port, Hello); err != nil {
		return nil, nil, sp, fmt.Errorf("agent port: %w", err)
	}
	sess, err := yamux.Server(port, channel.SessionConfig())
	if err != nil {
		return nil, nil, sp, err
	}
	first, err := sess.Accept()
	if err != nil {
		return nil, nil, sp, fmt.Errorf("wait for the Spec: %w", err)
	}
	if err := json.NewDecoder(bufio.NewReader(io.LimitReader(first, 1<<20))).Decode(&sp); err != nil {
		return nil, nil, sp, fmt.Errorf("read the Spec: %w", err)
	}
	return sess, first, sp, nil
}

// nextHostAgain greets the host that comes after the one serving left (a
// checkpoint: the VM is saved with its agent waiting here, and the host
// that resumes it connects), on a descriptor of its own of the port (a
// session closes its descriptor as it ends, which cuts short any write of
// the old session still waiting for a host). Its spec must be a resume's.
func nextHostAgain(port *os.File) (*yamux.Session, net.Conn, Spec, error) {
	conn, err := dupPort(port)
	if err != nil {
		return nil, nil, Spec{}, err
	}
	sess, first, sp, err := nextHost(conn)
	if err == nil && !sp.Resume {
		fmt.Fprintf(first, "error: a serving guest takes only a resume's spec\n")
		sess.Close()
		err = errors.New("a host sent a serving guest a spec that is not a resume's")
	}
	return sess, first, sp, err
}

// madeAgent is the agent's server, made (agent.New) in the sandbox's
// cgroup with no sandbox's identity yet: no token, environment or limits.
type madeAgent struct {
	srv *agent.Server
	cg  *cgroups.Cgroup // the sandbox's group in the guest, which holds the agent
}

// makeAgent puts the agent into the guest's cgroup of the sandbox (before
// the spawning thread takes a cgroup namespace rooted there) and makes its
// server, which serves nobody until serve configures it.
func makeAgent(threads int) (*madeAgent, error) {
	cg := cgroups.V2At(cgroupRoot, "cage").Open("sandbox")
	if err := cg.AddProc(os.Getpid()); err != nil {
		return nil, fmt.Errorf("guest cgroup: %w", err)
	}
	var ev cgroups.EventFiles
	var err error
	if ev.OOM, err = os.Open(cg.OOMEventsFile()); err != nil {
		return nil, err
	}
	if ev.Pids, err = os.Open(cg.PidsEventsFile()); err != nil {
		return nil, err
	}
	srv, err := agent.New(agent.Config{
		DefaultUser: inside.UserName, SpawnThreadSetup: spawnThread, AgentUID: inside.AgentUID, Threads: threads,
		Limits: ev,
	})
	if err != nil {
		return nil, err
	}
	return &madeAgent{srv: srv, cg: cg}, nil
}

// serve makes the guest the sandbox sp describes and serves the agent on
// sess. Its identity comes first: no command can run before the agent
// serves, and the agent serves only once the guest has its own random
// state, clock, name and limits and the agent its token. made is the
// agent a snapshot's guest made (nil in a guest booted cold, which makes
// it here, after its identity). disk is the root's upper tmpfs (see
// switchRoot), kept open for the agent's archives.
func serve(sess *yamux.Session, first net.Conn, sp Spec, made *madeAgent, port, disk *os.File) error {
	trace.Set(sp.Trace)
	trace.Mark("guest: spec read")
	made, err := become(sp, made)
	if err != nil {
		fmt.Fprintf(first, "error: %v\n", err)
		return err
	}
	srv := made.srv
	srv.Configure(sp.Token, sp.Env, sp.MaxOutput)
	// The root's upper layer is outside the root, reached through disk
	// (a descriptor opened before the chroot; no command inherits it):
	// the sandbox's changes are all there, and an archive walks only
	// them.
	upper := srv.ArchiveRootFrom(disk, "upper")
	if _, err := seal.Seal(seal.Options{AgentUID: inside.AgentUID, WritableRoot: true, Readable: []string{upper}}); err != nil {
		return err
	}
	trace.Mark("guest: sealed")
	if _, err := io.WriteString(first, Ready); err != nil {
		return err
	}
	first.Close()
	for {
		_ = srv.Serve(sess) // until the host leaves
		sess.Close()
		var sp Spec
		if sess, first, sp, err = nextHostAgain(port); err != nil {
			return err
		}
		if err := resumed(sp); err != nil {
			fmt.Fprintf(first, "error: %v\n", err)
			return err
		}
		if _, err := io.WriteString(first, Ready); err != nil {
			return err
		}
		first.Close()
	}
}

// become gives the guest sp's identity (random state, clock, hostname),
// network and limits, and returns its agent: made, or, in a guest booted
// cold, made here once the rest is done.
func become(sp Spec, made *madeAgent) (*madeAgent, error) {
	if err := freshIdentity(sp); err != nil {
		return nil, err
	}
	trace.Mark("guest: identity")
	if made != nil {
		if err := writeNames(sp.Hostname); err != nil {
			return nil, err
		}
	} else if err := inside.LoopbackUp(); err != nil {
		return nil, err
	}
	if sp.Net != nil {
		if err := netUp(sp.Net); err != nil {
			return nil, err
		}
	}
	trace.Mark("guest: names, network")
	if made == nil {
		var err error
		if made, err = makeAgent(sp.Threads); err != nil {
			return nil, err
		}
	}
	if err := made.cg.Apply(sp.Limits); err != nil {
		return nil, fmt.Errorf("guest cgroup: %w", err)
	}
	trace.Mark("guest: limits")
	return made, nil
}

// spawnThread prepares the thread that starts every command: a cgroup
// namespace of its own (commands see their group, the sandbox's, as the
// root, as on the other walls), then the sealing every wall does.
func spawnThread() error {
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("cgroup namespace: %w", err)
	}
	return seal.SpawnThread()
}

// netUp configures the guest's eth0 (the virtio-net device) as spec n
// says and writes its resolv.conf.
func netUp(n *Net) error {
	eth0, err := netlink.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("the guest's eth0: %w", err)
	}
	if err := netlink.AddrAdd(eth0, &netlink.Addr{IPNet: &net.IPNet{IP: n.IP.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
		return fmt.Errorf("address %s: %w", n.IP, err)
	}
	if err := netlink.LinkSetUp(eth0); err != nil {
		return err
	}
	gw := &net.IPNet{IP: n.Gateway.AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Dst: gw, Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("route to the gateway: %w", err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: n.Gateway.AsSlice()}); err != nil {
		return fmt.Errorf("default route: %w", err)
	}
	return os.WriteFile("/run/cage/resolv.conf", []byte(n.ResolvConf), 0o644)
}

// cgroupRoot is the guest's cgroup2 hierarchy, mounted by prepareCgroup
// in the initramfs's root, which no sandbox process can reach once the
// root has changed: a /proc/self/fd path of its directory.
var cgroupRoot string

// prepareCgroup mounts the guest's cgroup2 hierarchy out of the sandbox's
// sight, turns its controllers on and makes the sandbox's group, with no
// limits yet: done before a snapshot, so that no restored guest pays for it.
func prepareCgroup() error {
	const mnt = "/cgroup"
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("cgroup2", mnt, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount cgroup2: %w", err)
	}
	m, err := cgroups.Detect("cage")
	if err != nil {
		return err
	}
	if _, err := m.Create("sandbox", cgroups.Limits{}); err != nil {
		return fmt.Errorf("guest cgroup: %w", err)
	}
	// Close-on-exec: no command may hold the guest's cgroup root.
	fd, err := unix.Open(mnt, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	cgroupRoot = "/proc/self/fd/" + strconv.Itoa(fd)
	return nil
}

// freshIdentity gives the guest what no two sandboxes may share, which a
// guest restored from a snapshot has in common with all the others: the
// kernel's random state (the host's bytes, credited, then a reseed so that
// no output of the old state follows), the wall clock (stopped at the
// snapshot) and the hostname.
func freshIdentity(sp Spec) error {
	if err := setClock(sp); err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(sp.Hostname)); err != nil {
		return fmt.Errorf("set the hostname: %w", err)
	}
	return nil
}

// setClock mixes sp's random bytes into the kernel's RNG and sets the
// clock to sp's time.
func setClock(sp Spec) error {
	if len(sp.Entropy) < EntropyBytes {
		return fmt.Errorf("the Spec carries %d random bytes, want %d", len(sp.Entropy), EntropyBytes)
	}
	if sp.UnixNano == 0 {
		return errors.New("the Spec carries no time")
	}
	if err := addEntropy(sp.Entropy); err != nil {
		return err
	}
	ts := unix.NsecToTimespec(sp.UnixNano)
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		return fmt.Errorf("set the clock: %w", err)
	}
	return nil
}

// addEntropy mixes b into the kernel's RNG, credited in full, and reseeds
// its CRNG at once (RNDADDENTROPY alone would wait for the next reseed).
func addEntropy(b []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("add entropy: %w", err)
	}
	defer f.Close()
	// struct rand_pool_info: entropy_count (bits), buf_size (bytes), buf.
	info := make([]byte, 8+len(b))
	binary.NativeEndian.PutUint32(info[0:], uint32(8*len(b)))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(b)))
	copy(info[8:], b)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
		return fmt.Errorf("add entropy: %w", errno)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); errno != 0 {
		return fmt.Errorf("reseed the crng: %w", errno)
	}
	return nil
}

// resizeDisk sets the size of the root's upper layer, a tmpfs mounted
// before the spec said how big (dir is its root, opened then: the tmpfs
// is out of the chroot's reach by path).
func resizeDisk(dir *os.File, size, shm int64) error {
	target := "/proc/self/fd/" + strconv.Itoa(int(dir.Fd()))
	opts := fmt.Sprintf("size=%d,nr_inodes=%d", size, inside.InodesFor(size))
	if err := unix.Mount("", target, "", unix.MS_REMOUNT|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("resize the disk: %w", err)
	}
	if err := unix.Mount("", "/dev/shm", "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size="+strconv.FormatInt(shm, 10)); err != nil {
		return fmt.Errorf("resize /dev/shm: %w", err)
	}
	return nil
}

// switchRoot mounts the template's image (/dev/vda, read-only) under an
// overlay whose upper layer is a tmpfs of the disk size, gives it the
// sandbox's minimal /dev and a fresh /proc as on the process wall (the
// guest's devtmpfs and sysfs stay behind, reachable by the agent alone:
// boot.KeepDevices), and makes it the root (an initramfs cannot pivot_root:
// the new root is moved onto / and chrooted into, as switch_root does).
// It returns the tmpfs's root directory, for resizeDisk.
func switchRoot(sp Spec) (*os.File, error) {
	// Commands allocate as on a host, and meet the memory limit as an OOM
	// kill rather than a refused allocation: the guest's RAM is the limit
	// plus a little, so the default heuristic would refuse what the other
	// walls' hosts grant.
	if err := os.WriteFile("/proc/sys/vm/overcommit_memory", []byte("1"), 0); err != nil {
		return nil, err
	}
	for _, d := range []string{"/lower", "/rw", "/newroot"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := unix.Mount("/dev/vda", "/lower", "ext4", unix.MS_RDONLY|unix.MS_NODEV, ""); err != nil {
		return nil, fmt.Errorf("mount the template image: %w", err)
	}
	opts := fmt.Sprintf("mode=755,size=%d,nr_inodes=%d", sp.DiskBytes, inside.InodesFor(sp.DiskBytes))
	if err := unix.Mount("tmpfs", "/rw", "tmpfs", unix.MS_NODEV, opts); err != nil {
		return nil, fmt.Errorf("mount the disk: %w", err)
	}
	disk, err := os.OpenFile("/rw", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{"/rw/upper", "/rw/ovl"} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, err
		}
	}
	// mke2fs's lost+found is the image's, not the template's: whited out.
	if err := unix.Mknod("/rw/upper/lost+found", unix.S_IFCHR, 0); err != nil {
		return nil, err
	}
	if err := unix.Mount("overlay", "/newroot", "overlay", unix.MS_NODEV,
		"lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/ovl"); err != nil {
		return nil, fmt.Errorf("mount the root overlay: %w", err)
	}
	if err := inside.PrepareImageRoot("/newroot", sp.Hostname, func(id int) int { return id }, false); err != nil {
		return nil, err
	}
	if err := inside.BuildDev("/newroot", sp.ShmBytes); err != nil {
		return nil, err
	}
	// Guest root owns the tmpfs under the nodes: read-only, as Landlock
	// keeps it on the process wall.
	if err := unix.Mount("", "/newroot/dev", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC, ""); err != nil {
		return nil, fmt.Errorf("read-only /dev: %w", err)
	}
	if err := inside.MountProc("/newroot", nil); err != nil {
		return nil, err
	}
	if err := boot.KeepDevices(); err != nil {
		return nil, err
	}
	if err := prepareCgroup(); err != nil {
		return nil, err
	}
	if err := unix.Chdir("/newroot"); err != nil {
		return nil, err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return nil, fmt.Errorf("move the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return nil, err
	}
	if err := unix.Chdir("/"); err != nil {
		return nil, err
	}
	return disk, nil
}

// PowerOff ends the guest (QEMU, started with -no-reboot, then exits).
func PowerOff() {
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
}
