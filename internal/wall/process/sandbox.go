package process

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/rocache"
	"github.com/cagehq/cage/internal/spawner"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/process/child"
	"github.com/cagehq/cage/internal/wall/state"
)

// Config is what the process wall needs of the host.
type Config struct {
	AgentPath string // host path of the cage-agent binary
	RunDir    string // runtime state directory (e.g. /run/cage)
	Cgroups   *cgroups.Manager
	Log       *slog.Logger
	// Spawner, when set, starts the agents of sandboxes that outlive their
	// caller (a daemon's), so that a fork never copies the daemon's memory
	// (package spawner); nil forks from this process.
	Spawner *spawner.Client
}

// job is one sandbox to prepare.
type job struct {
	Config
	wall.Spec
	// Background prepares at low CPU priority (a pool refilling must not
	// slow the creates it serves); Start restores the normal priority.
	Background bool
}

// Sandbox is a running sandbox of the process wall, seen from the host.
type Sandbox struct {
	id    string
	token string // the agent's access token
	pid   int    // the agent, PID 1 of the sandbox, as the host sees it
	dir   string
	sock  string
	cg    *cgroups.Cgroup
	ids   *state.IDRange
	log   *slog.Logger

	owner         *os.File // flock'ed while this process owns the sandbox (see GC)
	root          string   // host directory the sandbox's root is mounted on
	specW         *os.File // the agent waits for its spec on the other end
	started       bool
	etc           string // the template /etc copy it was built with
	template      string // the template's name
	imageID       string // an image template's image ID
	image         bool   // the root is an image template's overlay
	niced         bool   // prepared at background priority
	prepared      bool   // made by Driver.Prepare: its network, or none, is fixed (Fits)
	agentPath     string // a prepared sandbox's agent binary, and its state.FileID then (Stale)
	agentID       string
	limits        cgroups.Limits // a prepared sandbox's, applied as it was made
	disk, shm     int64          // the sizes it was built with
	dieWithParent bool
	workloadFD    int // the child's descriptor of its workload group's tasks file, 0 if none
	runFD         int // a one-shot run's: the child's descriptor of the first of its pipes
	pidfd         int // set for an agent that is not this process's child (adopted, or the spawner's)
	net           *network.Sandbox

	exited  chan struct{} // closed when the agent has been reaped
	waitErr error
	stderr  *tailBuffer
	destroy sync.Once
	destErr error
}

// ID is the sandbox's id.
func (sb *Sandbox) ID() string { return sb.id }

// Token is the agent's access token.
func (sb *Sandbox) Token() string { return sb.token }

// AgentPID is the host pid of the sandbox's agent (its PID 1).
func (sb *Sandbox) AgentPID() int { return sb.pid }

// DiskPath is a host path on the sandbox's storage, for its usage: an
// image's disk is a tmpfs on the host (template.MountImage), whose path is
// the host's alone; the host template's is reached through the agent's
// root as its /tmp, a mount point on a read-only root, which nothing
// inside can replace. (An image's /tmp is the sandbox's to replace, with
// a symlink to a host path, say.)
func (sb *Sandbox) DiskPath() string {
	if disk := filepath.Join(sb.dir, "disk"); state.IsMountPoint(disk) {
		return disk
	}
	return fmt.Sprintf("/proc/%d/root/tmp", sb.pid)
}

// Wall is "process".
func (sb *Sandbox) Wall() string { return "process" }

// prepare does everything that does not depend on what the sandbox is for:
// it reserves ids, makes the directories and the agent's socket, forks the
// agent into its namespaces and puts it in its cgroups (without limits yet).
// The agent then waits for Start. A pool keeps prepared sandboxes, so that a
// create pays none of this; if the host goes away, the agent sees its spec
// pipe close and exits.
func prepare(ctx context.Context, cfg job) (sb *Sandbox, err error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	sb = &Sandbox{id: cfg.ID, dir: filepath.Join(cfg.RunDir, "sandboxes", cfg.ID), exited: make(chan struct{}),
		log: cfg.Log.With("sandbox", cfg.ID)}
	sb.sock = filepath.Join(sb.dir, "agent.sock")
	defer func() {
		if errors.Is(err, state.ErrInUse) {
			sb.ids.Release() // the directory and all in it are another's
			sb = nil
		} else if err != nil {
			_ = sb.Destroy()
			sb = nil
		}
	}()
	// The sandbox's root user must be able to reach its root directory.
	if err := os.MkdirAll(cfg.RunDir, 0o711); err != nil {
		return sb, err
	}
	if err := os.Chmod(cfg.RunDir, 0o711); err != nil {
		return sb, err
	}
	trace.Mark("create")
	if sb.ids, err = state.ReserveIDs(); err != nil {
		return sb, err
	}
	if sb.root, err = sb.makeDirs(); err != nil {
		return sb, err
	}
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		return sb, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sb.sock, Net: "unix"})
	if err != nil {
		return sb, fmt.Errorf("agent socket: %w", err)
	}
	l.SetUnlinkOnClose(false)
	lf, err := l.File()
	l.Close() // the child's copy keeps the socket listening
	if err != nil {
		return sb, err
	}
	defer lf.Close()
	sb.template = cfg.Template.Name
	sb.image = cfg.Template.Image != nil
	if sb.image {
		sb.imageID = cfg.Template.Image.Info.ID
	}
	rootSock, err := sb.fork(cfg, lf)
	if err != nil {
		return sb, err
	}
	image := ""
	if sb.image {
		// The image's root is mounted now that the child's user namespace
		// exists (its layers are idmapped through it); the child attaches
		// a detached copy of the mount.
		image, err = sb.sendImageRoot(cfg, rootSock)
		if err != nil {
			rootSock.Close()
			return sb, err
		}
		trace.Mark("image mounted")
	}
	if len(cfg.Volumes) > 0 {
		err = sb.sendVolumes(cfg.Volumes, rootSock)
		if err != nil {
			rootSock.Close()
			return sb, err
		}
	}
	if rootSock != nil {
		rootSock.Close()
	}
	volumes := make([]string, 0, len(cfg.Volumes))
	for _, v := range cfg.Volumes {
		volumes = append(volumes, v.Path)
	}
	// The child builds the sandbox now, from the template and the default
	// sizes in cfg, and then waits for Start.
	sb.etc = cfg.Template.EtcCache
	sb.disk, sb.shm = cfg.DiskBytes, cfg.ShmBytes
	resolvConf := ""
	if networked(cfg.Spec) {
		resolvConf = cfg.Net.ResolvConf()
	}
	err = sb.send(&child.InitSpec{
		ID: sb.id, Hostname: cfg.Hostname, Root: sb.root, ResolvConf: resolvConf,
		Mounts: cfg.Template.Mounts, Image: image, Build: cfg.Template.Build, Volumes: volumes, DiskBytes: sb.disk, DiskInodes: inside.InodesFor(sb.disk),
		ShmBytes: sb.shm, UserName: inside.UserName, UserUID: inside.UserUID, UserGID: inside.UserUID,
		OOMEvents: sb.cg.OOMEventsFile(), PidsEvents: sb.cg.PidsEventsFile(), WorkloadTasks: sb.workloadFD,
		Debug: trace.On(), DieWithParent: sb.dieWithParent, Run: runSpec(cfg.Spec.Run, sb.runFD),
	})
	return sb, err
}

// runSpec is what the child needs of a one-shot run: its pipes are its
// descriptors from fd on.
func runSpec(r *wall.Run, fd int) *child.RunSpec {
	if r == nil {
		return nil
	}
	return &child.RunSpec{Cmd: r.Cmd, Args: r.Args, Cwd: r.Cwd, User: r.User, Env: r.Env, FD: fd}
}

// send writes one spec document to the child.
func (sb *Sandbox) send(doc any) error {
	data, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	if _, err := sb.specW.Write(append(data, '\n')); err != nil {
		return fmt.Errorf("send the sandbox spec: %w (agent: %s)", err, sb.stderr.String())
	}
	return nil
}

// Start applies the limits and network policy and sends the agent the
// request's own settings (the agent, sealed already, then serves).
func (sb *Sandbox) Start(s wall.Spec) error {
	if sb.started {
		return errors.New("sandbox already started")
	}
	if s.Template.EtcCache != sb.etc || s.Template.Name != sb.template ||
		(s.Template.Image != nil && s.Template.Image.Info.ID != sb.imageID) {
		return wall.ErrStale
	}
	sb.started = true
	sb.token = s.Token
	if sb.niced {
		sb.renice()
	}
	if !sb.prepared || s.Limits != sb.limits {
		if err := sb.cg.Apply(s.Limits); err != nil {
			return err
		}
	}
	trace.Mark("limits applied")
	if sb.net != nil { // prepared with its interface (Driver.Prepare)
		if err := sb.net.SetFirstPolicy(s.NetPolicy); err != nil {
			return err
		}
	} else if err := sb.attachNetwork(s); err != nil {
		return err
	}
	trace.Mark("network attached")
	disk, shm := s.DiskBytes, s.ShmBytes
	if disk == 0 {
		disk = sb.disk
	}
	if sb.image && disk != sb.disk {
		if err := template.ResizeImageDisk(sb.dir, disk, inside.InodesFor(disk)); err != nil {
			return err
		}
	}
	if shm == 0 {
		shm = sb.shm
	}
	err := sb.send(&child.StartSpec{Token: s.Token, Env: s.Env, MaxOutput: s.MaxOutput,
		DiskBytes: disk, DiskInodes: inside.InodesFor(disk), ShmBytes: shm})
	sb.specW.Close()
	sb.specW = nil
	if err != nil {
		return err
	}
	trace.Mark("spec sent")
	return nil
}

// attachNetwork gives the sandbox's own network namespace a veth under the
// policy, when s asks for a network (its resolv.conf went with InitSpec).
func (sb *Sandbox) attachNetwork(s wall.Spec) error {
	if !networked(s) {
		return nil
	}
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", sb.pid))
	if err != nil {
		return fmt.Errorf("the sandbox's network namespace: %w", err)
	}
	defer ns.Close()
	if sb.net, err = s.Net.Attach(sb.id, sb.ids.Slot(), int(ns.Fd()), s.NetPolicy); err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	return nil
}

func networked(s wall.Spec) bool { return s.Net != nil && s.NetPolicy.Networked() }

// Network is the sandbox's network, nil when it has none.
func (sb *Sandbox) Network() *network.Sandbox { return sb.net }

// SetNetwork hands an adopted sandbox the network taken over for it.
func (sb *Sandbox) SetNetwork(n *network.Sandbox) { sb.net = n }

// backgroundNice is the priority prepared sandboxes are built at.
const backgroundNice = 15

// renice puts every thread of the agent back to normal priority (each
// inherited the background value; a thread made during the walk too, seen
// once in the conformance suite: hostproc.Foreground walks again).
func (sb *Sandbox) renice() {
	hostproc.Foreground(sb.pid)
	sb.niced = false
}

// makeDirs creates the sandbox's state directory and the empty directory its
// root is mounted on, which belongs to the sandbox's root user.
func (sb *Sandbox) makeDirs() (string, error) {
	if err := os.MkdirAll(filepath.Dir(sb.dir), 0o711); err != nil {
		return "", err
	}
	// The sandbox's root user traverses it to its root (as its group);
	// no other host user may: an image template's overlay is mounted in
	// it, whose files are the sandbox's.
	if err := state.MakeDir(sb.dir, 0o710); err != nil {
		return "", err
	}
	if err := os.Chown(sb.dir, 0, sb.ids.HostID(0)); err != nil {
		return "", err
	}
	root := filepath.Join(sb.dir, "root")
	if err := os.Mkdir(root, 0o700); err != nil {
		return "", err
	}
	if err := os.Chown(root, sb.ids.HostID(0), sb.ids.HostID(0)); err != nil {
		return "", err
	}
	return root, nil
}

// fork starts the agent in new namespaces and puts it in new cgroups; it
// then waits for its spec (Start).
func (sb *Sandbox) fork(cfg job, listener *os.File) (rootSock *os.File, err error) {
	// The agent runs from a copy on huge pages (fewer page faults at each
	// start); a replaced binary gets a copy of its own.
	exe, err := rocache.Executable(filepath.Join(cfg.RunDir, "agents"), cfg.AgentPath, "cage-agent")
	if err != nil {
		return nil, fmt.Errorf("the sandbox's agent %s: %w", cfg.AgentPath, err)
	}
	specR, specW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer specR.Close()
	sb.specW = specW
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer errW.Close()
	sb.stderr = newTailBuffer(4096)
	go sb.stderr.drain(errR, sb.log)

	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer devnull.Close()
	files := []uintptr{devnull.Fd(), errW.Fd(), errW.Fd(), specR.Fd(), listener.Fd(), sb.ids.Held.Fd()}
	if sb.image || len(cfg.Volumes) > 0 {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		rootSock = os.NewFile(uintptr(fds[0]), "root")
		child := os.NewFile(uintptr(fds[1]), "root")
		defer child.Close()
		defer func() {
			if err != nil {
				rootSock.Close()
			}
		}()
		files = append(files, child.Fd()) // fdRoot
	}
	// The agent runs with one P from its start (GOMAXPROCS=1; the
	// commands it starts get their own environment, not this one): a
	// second P makes Go's scheduler wake threads that find nothing to do,
	// and the switch to one after the seal stops the world. Its root and
	// its server are still made at once, each while the other waits in a
	// system call. Measured with 8 creates in flight through the API: the
	// CPU per sandbox 8% less, the rate 17% more (docs/BENCHMARKS.md).
	attr := &syscall.ProcAttr{
		Dir:   "/",
		Env:   []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "CAGE_TRACE=" + os.Getenv("CAGE_TRACE"), "GOMAXPROCS=1"},
		Files: files,
		Sys: &syscall.SysProcAttr{
			Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID | syscall.CLONE_NEWNS |
				syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS | syscall.CLONE_NEWNET,
			UidMappings:                sb.ids.Maps(),
			GidMappings:                sb.ids.Maps(),
			GidMappingsEnableSetgroups: true,
			Credential:                 &syscall.Credential{Uid: 0, Gid: 0},
			Setsid:                     true,
		},
	}
	// The agent is born in its cgroups (cgroups.Spawn), without limits
	// yet; it waits for its spec, which comes only once it is inside them.
	if sb.cg, err = cfg.Cgroups.Create(cfg.ID, cgroups.Limits{}); err != nil {
		return nil, err
	}
	// The workload's own pids group, where cgroups can make one: the agent
	// keeps AgentThreads of the limit to itself without taking them ahead
	// (the thread it forks from is the workload's, hence one less).
	tasks, err := sb.cg.SplitPids(inside.AgentThreads - 1)
	if err != nil {
		return nil, fmt.Errorf("the workload's pids group: %w", err)
	}
	if tasks != nil {
		defer tasks.Close()
		sb.workloadFD = len(attr.Files)
		attr.Files = append(attr.Files, tasks.Fd())
	}
	if r := cfg.Spec.Run; r != nil {
		// A one-shot run's pipes, in child.RunSpec's order.
		sb.runFD = len(attr.Files)
		for _, f := range []*os.File{r.Stdin, r.Stdout, r.Stderr, r.Control, r.Status} {
			if f == nil {
				return nil, errors.New("a one-shot run needs all five of its pipes")
			}
			attr.Files = append(attr.Files, f.Fd())
		}
	}
	sb.dieWithParent = cfg.DieWithCaller
	if cfg.DieWithCaller {
		// The parent-death signal follows the thread that forked (Spawn
		// forks from a thread that lives as long as the process).
		attr.Sys.Pdeathsig = syscall.SIGKILL
	}
	trace.Mark("fork")
	argv := []string{"cage-agent", "init"}
	if cfg.Spawner != nil && !cfg.DieWithCaller {
		err = sb.spawn(cfg, exe, argv, attr)
	} else {
		var pid int
		pid, err = sb.cg.Spawn(func(cgroupFD int) (int, error) {
			attr.Sys.UseCgroupFD, attr.Sys.CgroupFD = cgroupFD >= 0, cgroupFD
			// The sandbox's user namespace is its root's host uid's, not
			// root's (spawner.ForkOwned).
			return spawner.ForkOwned(sb.ids.HostID(0), sb.ids.HostID(0), func() (int, error) {
				return spawner.CloneExec(exe, argv, attr)
			})
		})
		if pid > 0 {
			sb.pid = pid
			go sb.reap()
		}
		if err == nil && cfg.Background {
			_ = unix.Setpriority(unix.PRIO_PROCESS, pid, backgroundNice)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("start the sandbox's agent %s: %w", cfg.AgentPath, err)
	}
	sb.niced = cfg.Background
	trace.Mark("in cgroups")
	return rootSock, nil
}

// sendImageRoot mounts an image template's root (through the child's own
// user namespace) and sends the child a detached copy of it.
func (sb *Sandbox) sendImageRoot(cfg job, sock *os.File) (string, error) {
	userns := func() (int, error) {
		return unix.Open(fmt.Sprintf("/proc/%d/ns/user", sb.pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	var nsFD = -1
	once := func() (int, error) {
		if nsFD < 0 {
			var err error
			nsFD, err = userns()
			return nsFD, err
		}
		return nsFD, nil
	}
	defer func() {
		if nsFD >= 0 {
			unix.Close(nsFD)
		}
	}()
	root, err := cfg.Template.MountImage(sb.dir, uint32(sb.ids.Base), once, cfg.DiskBytes, inside.InodesFor(cfg.DiskBytes))
	if err != nil {
		return "", err
	}
	tree, err := template.DetachedRoot(root)
	if err != nil {
		return "", err
	}
	defer tree.Close()
	if err := unix.Sendmsg(int(sock.Fd()), []byte("root"), unix.UnixRights(int(tree.Fd())), nil, 0); err != nil {
		return "", fmt.Errorf("send the sandbox its root: %w", err)
	}
	return root, nil
}

func (sb *Sandbox) reap() {
	var ws syscall.WaitStatus
	for {
		_, err := syscall.Wait4(sb.pid, &ws, 0, nil)
		if err != syscall.EINTR {
			if err != nil {
				sb.waitErr = err
			}
			break
		}
	}
	if sb.waitErr == nil && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
		sb.waitErr = fmt.Errorf("agent exited (%v)", describe(ws))
	}
	sb.explainOOM()
	close(sb.exited)
}

// explainOOM says, of an agent killed with nothing else said, that the
// kernel's OOM killer has been at work in the sandbox: it may choose the
// agent, since the workload's memory (socket buffers, tmpfs files) is the
// group's but no process's, and the agent is then its largest member.
func (sb *Sandbox) explainOOM() {
	if sb.waitErr != nil || sb.cg == nil {
		return
	}
	f, err := os.Open(sb.cg.OOMEventsFile())
	if err != nil {
		return
	}
	defer f.Close()
	if cgroups.Counter(f, "oom_kill") > 0 {
		sb.waitErr = errors.New("out of memory: the sandbox reached its memory limit and the kernel killed its agent")
	}
}

// spawn starts the agent through the spawner, which forks it from its own
// small address space and answers with a pidfd: the agent is then watched
// and killed as an adopted one is.
func (sb *Sandbox) spawn(cfg job, exe string, argv []string, attr *syscall.ProcAttr) error {
	req := spawner.Request{Path: exe, Argv: argv, Env: attr.Env, Dir: attr.Dir,
		Cloneflags: attr.Sys.Cloneflags, UIDMaps: attr.Sys.UidMappings, GIDMaps: attr.Sys.GidMappings,
		Setgroups: attr.Sys.GidMappingsEnableSetgroups, Setsid: attr.Sys.Setsid,
		CgroupParent: cfg.Cgroups.Parent, Cgroup: sb.cg.Name}
	if cfg.Background {
		req.Nice = backgroundNice
	}
	child, err := cfg.Spawner.Spawn(req, attr.Files)
	if err != nil {
		return err
	}
	sb.pid, sb.pidfd = child.PID, child.Pidfd
	go func() {
		hostproc.WaitPidfd(sb.pidfd)
		// How it ended comes from the spawner, right after; the pidfd
		// alone says that it did (a spawner that died says nothing).
		select {
		case ws, ok := <-child.Status:
			if ok && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
				sb.waitErr = fmt.Errorf("agent exited (%v)", describe(ws))
			}
		case <-time.After(5 * time.Second):
		}
		sb.explainOOM()
		close(sb.exited)
	}()
	return nil
}

func describe(ws syscall.WaitStatus) string {
	if ws.Signaled() {
		return "signal " + ws.Signal().String()
	}
	return fmt.Sprintf("status %d", ws.ExitStatus())
}

// Dial connects to the sandbox's agent.
func (sb *Sandbox) Dial(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", sb.sock)
	if err != nil {
		select {
		case <-sb.exited:
			return nil, sb.Err()
		default:
		}
		return nil, fmt.Errorf("dial sandbox %s: %w", sb.id, err)
	}
	return c, nil
}

// Exited is closed when the sandbox's agent is gone.
func (sb *Sandbox) Exited() <-chan struct{} { return sb.exited }

// Err explains why the sandbox died, with the last words of its agent.
func (sb *Sandbox) Err() error {
	if sb.stderr != nil {
		select {
		case <-sb.stderr.done:
		case <-time.After(200 * time.Millisecond):
		}
	}
	msg := strings.TrimSpace(sb.stderr.String())
	if msg != "" {
		return fmt.Errorf("sandbox %s failed: %s", sb.id, lastLine(msg))
	}
	if sb.waitErr != nil {
		return fmt.Errorf("sandbox %s: %w", sb.id, sb.waitErr)
	}
	return fmt.Errorf("sandbox %s is gone", sb.id)
}

func lastLine(s string) string {
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// Cgroup is the sandbox's control group.
func (sb *Sandbox) Cgroup() *cgroups.Cgroup { return sb.cg }

// Destroy kills every process of the sandbox and removes everything it had
// on the host: cgroups, state directory, uid range. Killing PID 1 of a PID
// namespace kills every process in it, however it forked; namespaces and
// mounts go with the last process. It is safe to call more than once.
func (sb *Sandbox) Destroy() error {
	sb.destroy.Do(func() { sb.destErr = sb.teardown() })
	return sb.destErr
}

func (sb *Sandbox) teardown() error {
	trace.Mark("teardown")
	defer trace.Mark("torn down")
	var errs []error
	if sb.specW != nil {
		sb.specW.Close()
	}
	if sb.cg != nil {
		_ = sb.cg.Thaw() // a paused sandbox's agent does not die frozen
	}
	switch {
	case sb.pidfd > 0:
		_ = unix.PidfdSendSignal(sb.pidfd, unix.SIGKILL, nil, 0)
		<-sb.exited
		unix.Close(sb.pidfd)
	case sb.pid > 0:
		select {
		case <-sb.exited:
			// Reaped already (it died on its own): its pid may be another
			// process's by now, which a signal must not reach. (Reuse needs
			// the whole pid space to wrap, so the moment between this
			// check and the kill is no window for one.)
		default:
			_ = syscall.Kill(sb.pid, syscall.SIGKILL)
		}
		<-sb.exited
	}
	trace.Mark("reaped")
	if sb.cg != nil {
		errs = append(errs, sb.cg.Destroy())
	}
	trace.Mark("cgroups removed")
	if sb.net != nil {
		errs = append(errs, sb.net.Close()) // before the slot can be reused
	}
	if sb.dir != "" {
		if err := state.RemoveState(sb.dir); err != nil {
			errs = append(errs, err)
		}
	}
	if sb.owner != nil {
		sb.owner.Close()
	}
	sb.ids.Release()
	return errors.Join(errs...)
}

// tailBuffer keeps the last bytes the agent wrote to stderr: what it says
// when setup fails. The agent is untrusted, so only a bounded tail is kept.
type tailBuffer struct {
	mu   sync.Mutex
	max  int
	buf  []byte
	done chan struct{}
}

// maxLoggedStderr bounds what is logged of an agent's stderr.
const maxLoggedStderr = 64 << 10

func newTailBuffer(max int) *tailBuffer { return &tailBuffer{max: max, done: make(chan struct{})} }

func (t *tailBuffer) drain(r io.ReadCloser, log *slog.Logger) {
	defer close(t.done)
	defer r.Close()
	chunk := make([]byte, 4096)
	logged := 0
	for {
		n, err := r.Read(chunk)
		if n > 0 {
			// At --debug, only its first maxLoggedStderr bytes: the
			// agent is the sandbox's to replace, and every byte it
			// wrote went to the daemon's log (found by review,
			// 2026-12-05).
			if logged < maxLoggedStderr {
				log.Debug("agent stderr", "text", string(chunk[:min(n, maxLoggedStderr-logged)]))
				if logged += n; logged >= maxLoggedStderr {
					log.Debug("agent stderr: the rest is not logged", "logged_bytes", maxLoggedStderr)
				}
			}
			t.mu.Lock()
			t.buf = append(t.buf, chunk[:n]...)
			if len(t.buf) > t.max {
				t.buf = append([]byte(nil), t.buf[len(t.buf)-t.max:]...)
			}
			t.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

func (t *tailBuffer) String() string {
	if t == nil {
		return ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
