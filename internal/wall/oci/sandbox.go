// Package oci is the runc and gVisor walls: cage writes an OCI bundle whose
// init is cage-agent, and runs it with runc or gVisor's runsc. The agent
// then seals itself as on the process wall and serves on a socket the host
// reaches through Dial: passed in as a listening descriptor under runc, a
// host socket gVisor creates on a shared directory under runsc.
package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/channel"
	"github.com/cagehq/cage/internal/wall/oci/container"
	"github.com/cagehq/cage/internal/wall/state"
)

// Runtime is an OCI runtime binary and how cage invokes it.
type Runtime struct {
	Wall   string   // "runc" or "gvisor"
	Binary string   // path of runc or runsc
	Flags  []string // global flags (runsc: --platform=systrap --network=none ...)
}

func (r *Runtime) gvisor() bool { return r.Wall == "gvisor" }

// flags are the runtime's global flags for a sandbox: gVisor's netstack
// takes over the sandbox's interface when it has a network.
func (r *Runtime) flags(networked bool) []string {
	out := append([]string{}, r.Flags...)
	for i, f := range out {
		if f == "--network=none" && networked {
			out[i] = "--network=sandbox"
		}
	}
	return out
}

// attachNetwork makes the sandbox's network namespace with its veth, before
// the runtime starts (gVisor reads the interfaces it finds as it starts),
// and returns its resolv.conf. made, when not -1, is the namespace made
// for it (runc's: see ownedNamespaces), pinned at the same path.
func (sb *Sandbox) attachNetwork(cfg job, made int) (string, error) {
	if cfg.Net == nil || !cfg.NetPolicy.Networked() {
		return inside.NoNetworkResolvConf, nil
	}
	path := filepath.Join(sb.dir, "netns")
	pin := network.NewNamespace
	if made >= 0 {
		pin = func(path string) error { return network.PinNamespace(made, path) }
	}
	if err := pin(path); err != nil {
		return "", fmt.Errorf("sandbox network namespace: %w", err)
	}
	sb.netns = path
	ns, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer ns.Close()
	if sb.net, err = cfg.Net.Attach(sb.id, sb.ids.Slot(), int(ns.Fd()), cfg.NetPolicy); err != nil {
		return "", fmt.Errorf("sandbox network: %w", err)
	}
	return cfg.Net.ResolvConf(), nil
}

// Network is the sandbox's network, nil when it has none.
func (sb *Sandbox) Network() *network.Sandbox { return sb.net }

// SetNetwork hands an adopted sandbox the network taken over for it.
func (sb *Sandbox) SetNetwork(n *network.Sandbox) {
	sb.net = n
	if p := filepath.Join(sb.dir, "netns"); fileExists(p) {
		sb.netns = p
	}
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// runtimeRoot makes the runtime's state directory (--root) root's alone,
// 0700, before the runtime makes it itself: runsc makes it 0711 and its
// sandboxes' control sockets in it with the daemon's umask, and a socket
// any host user may connect to runs commands as root in the sandbox
// (containerManager.ExecuteAsync). Found by review, 2026-12-03: a daemon
// started under umask 000 left RUN/gvisor/runsc-ID.sock 0777 in a 0711
// directory. A directory left 0711 by an older cage is made 0700.
func runtimeRoot(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.IsDir() || !ok || st.Uid != 0 {
		return fmt.Errorf("%s: the runtime's state directory is not a directory of root's", dir)
	}
	if fi.Mode().Perm() != 0o700 {
		return os.Chmod(dir, 0o700)
	}
	return nil
}

// Config is what an OCI wall needs of the host.
type Config struct {
	AgentPath string
	RunDir    string
	Cgroups   *cgroups.Manager
	Runtime   *Runtime
	Log       *slog.Logger
}

// job is one container to make: a sandbox's, or a bare run's (the
// benchmark peer: bare is its command, with stdout to bareOut).
type job struct {
	Config
	wall.Spec
	bare    []string
	bareOut io.Writer
	// prepare: the agent is started but waits for the request's part of
	// its spec, which Start sends (see prepare.go); background: at low CPU
	// priority until then.
	prepare, background bool
}

// Sandbox is a running sandbox of an OCI wall.
type Sandbox struct {
	id, token string
	rt        *Runtime
	pid       int
	pidfd     int
	dir, sock string
	root      string // runtime state root
	cg        *cgroups.Cgroup
	ids       *state.IDRange
	owner     *os.File
	diskMount string
	rootfs    string
	lifeline  *os.File // write end of the lifeline (DieWithCaller)
	specW     *os.File // a prepared sandbox's spec pipe, until Start
	net       *network.Sandbox
	netns     string        // the network namespace made for it (a network's)
	ch        *channel.Host // gVisor: the agent connects to the host
	exited    chan struct{} // closed once the sandbox is gone for good
	gone      sync.Once
	procDone  chan struct{} // closed once the current container process has exited
	log       *slog.Logger

	prep *preparation // made ahead of its request (prepare.go); nil when not

	mu       sync.Mutex
	stderr   []byte
	stopping bool // a checkpoint stops the container: its exit is no death
	destroy  sync.Once
	destErr  error
}

func (sb *Sandbox) ID() string              { return sb.id }
func (sb *Sandbox) Token() string           { return sb.token }
func (sb *Sandbox) AgentPID() int           { return sb.pid }
func (sb *Sandbox) Wall() string            { return sb.rt.Wall }
func (sb *Sandbox) Exited() <-chan struct{} { return sb.exited }
func (sb *Sandbox) Cgroup() *cgroups.Cgroup { return sb.cg }
func (sb *Sandbox) DiskPath() string        { return sb.diskMount }

// Dial connects to the agent: under runc to the socket the host made and
// passed it, under gVisor through the channel the agent connected to
// (see package channel), waiting for the agent if it has not yet.
func (sb *Sandbox) Dial(ctx context.Context) (net.Conn, error) {
	var c net.Conn
	var err error
	if sb.ch != nil {
		c, err = sb.ch.Dial(ctx, sb.exited)
	} else {
		var d net.Dialer
		c, err = d.DialContext(ctx, "unix", sb.sock)
	}
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

// Err says why the sandbox is gone.
func (sb *Sandbox) Err() error {
	sb.mu.Lock()
	msg := strings.TrimSpace(string(sb.stderr))
	sb.mu.Unlock()
	if msg != "" {
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:]
		}
		return fmt.Errorf("sandbox %s (%s) failed: %s", sb.id, sb.rt.Wall, msg)
	}
	return fmt.Errorf("sandbox %s (%s) is gone", sb.id, sb.rt.Wall)
}

// create builds the bundle and starts the container. On error nothing is
// left behind.
func create(ctx context.Context, cfg job) (sb *Sandbox, err error) {
	sb = &Sandbox{id: cfg.ID, token: cfg.Token, rt: cfg.Runtime, exited: make(chan struct{}), pidfd: -1,
		dir: filepath.Join(cfg.RunDir, "sandboxes", cfg.ID), root: filepath.Join(cfg.RunDir, cfg.Runtime.Wall),
		log: cfg.Log.With("sandbox", cfg.ID, "wall", cfg.Runtime.Wall)}
	defer func() {
		if errors.Is(err, state.ErrInUse) {
			sb.ids.Release() // the directory and all in it are another's
			sb = nil
		} else if err != nil {
			_ = sb.Destroy()
			sb = nil
		}
	}()
	if err := os.MkdirAll(cfg.RunDir, 0o711); err != nil {
		return sb, err
	}
	if err := runtimeRoot(sb.root); err != nil {
		return sb, err
	}
	if sb.ids, err = state.ReserveIDs(); err != nil {
		return sb, err
	}
	if err := os.MkdirAll(filepath.Dir(sb.dir), 0o711); err != nil {
		return sb, err
	}
	// The container's root user traverses it to the bundle (as its
	// group); no other host user may: the sandbox's disk and an image
	// root are mounted in it.
	if err := state.MakeDir(sb.dir, 0o710); err != nil {
		return sb, err
	}
	if err := os.Chown(sb.dir, 0, sb.ids.HostID(0)); err != nil {
		return sb, err
	}
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		return sb, err
	}
	if sb.cg, err = cfg.Cgroups.Create(cfg.ID, cfg.Limits); err != nil {
		return sb, err
	}
	if cfg.Template.Image == nil {
		if err := sb.makeDisk(cfg); err != nil {
			return sb, err
		}
	}
	usernsPath, netFD := "", -1
	if !cfg.Runtime.gvisor() {
		// runc joins the namespaces by these paths as it starts the
		// container, which then holds them.
		userFD, nfd, err := ownedNamespaces(sb.ids.HostID(0), cfg.AgentPath, cfg.Net != nil && cfg.NetPolicy.Networked())
		if err != nil {
			return sb, err
		}
		defer unix.Close(userFD)
		if nfd >= 0 {
			defer unix.Close(nfd)
		}
		usernsPath, netFD = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), userFD), nfd
	}
	resolvConf, err := sb.attachNetwork(cfg, netFD)
	if err != nil {
		return sb, err
	}
	if cfg.prepare {
		if sb.prep, err = newPreparation(cfg, sb.netns != ""); err != nil {
			return sb, err
		}
	}
	agentCopy, err := agentCopy(cfg.RunDir, cfg.AgentPath)
	if err != nil {
		return sb, err
	}
	if cfg.Template.Image != nil {
		// An image template: its overlay is the root, its upper layer on
		// the sandbox's disk; under runc its layers are idmapped to the
		// sandbox's uid range, gVisor serves host ids as they are.
		idBase := uint32(sb.ids.Base)
		if cfg.Runtime.gvisor() {
			idBase = 0
		}
		inodes := max(4096, cfg.DiskBytes/8192)
		userns := template.HeldUserNS(idBase, cfg.AgentPath)
		if sb.rootfs, err = cfg.Template.MountImage(sb.dir, idBase, userns, cfg.DiskBytes, inodes); err != nil {
			return sb, err
		}
		sb.diskMount = filepath.Join(sb.dir, "disk")
	} else {
		sb.rootfs = filepath.Join(sb.dir, "rootfs")
		if err := os.Mkdir(sb.rootfs, 0o755); err != nil {
			return sb, err
		}
		if err := unix.Mount("tmpfs", sb.rootfs, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=1m,nr_inodes=1024,mode=755"); err != nil {
			return sb, fmt.Errorf("mount the sandbox root: %w", err)
		}
	}
	volumes, err := sb.attachVolumes(cfg)
	if err != nil {
		return sb, err
	}
	b := &bundleConfig{dir: filepath.Join(sb.dir, "bundle"), rootfs: sb.rootfs, id: cfg.ID, hostname: cfg.Hostname, volumes: volumes,
		agentPath: agentCopy, template: cfg.Template, disk: sb.diskMount,
		cgroupPath: cgroupsPath(cfg.Cgroups, cfg.ID), shmBytes: cfg.ShmBytes,
		idBase: uint32(sb.ids.Base), userns: !cfg.Runtime.gvisor(), usernsPath: usernsPath, args: []string{agentInside, "serve"},
		netns: sb.netns, resolvConf: resolvConf, image: cfg.Template.Image != nil}
	if cfg.bare != nil {
		b.args = cfg.bare
	}
	var setup func() error // on runc's side, before it starts (see runAt)
	if b.userns && !b.image {
		b.layers = filepath.Join(sb.dir, layersDir)
		setup = func() error { return mountLayers(b.layers, cfg.Template.Mounts) }
	}
	var key []byte
	if cfg.Runtime.gvisor() && cfg.bare == nil {
		b.sockDir = filepath.Join(sb.dir, chanDir)
		if key, err = sb.listenChannel(); err != nil {
			return sb, err
		}
	} else {
		sb.sock = filepath.Join(sb.dir, "agent.sock")
	}
	if err := os.MkdirAll(b.dir, 0o711); err != nil {
		return sb, err
	}
	if err := b.write(); err != nil {
		return sb, err
	}
	if cfg.bare != nil {
		return sb, sb.runBare(ctx, cfg, setup)
	}
	return sb, sb.run(ctx, cfg, key, setup)
}

// runBareJob runs cfg.bare as the container's process (see Driver.RunBare).
func runBareJob(ctx context.Context, cfg job) error {
	sb, err := create(ctx, cfg)
	if sb != nil {
		if derr := sb.Destroy(); err == nil {
			err = derr
		}
	}
	return err
}

func (sb *Sandbox) runBare(ctx context.Context, cfg job, setup func() error) error {
	args := append(append([]string{}, cfg.Runtime.Flags...), "--root", sb.root, "run", "--bundle",
		filepath.Join(sb.dir, "bundle"), sb.id)
	cmd := exec.CommandContext(ctx, cfg.Runtime.Binary, args...)
	cmd.Stdout = cfg.bareOut
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := runAt(cmd, 0, setup); err != nil {
		return fmt.Errorf("%s run: %v: %s", filepath.Base(cfg.Runtime.Binary), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// cgroupsPath is the runtime's cgroupsPath for the group cage made.
func cgroupsPath(m *cgroups.Manager, id string) string { return "/" + m.Parent + "/" + id }

// makeDisk mounts the sandbox's writable storage on the host: one size- and
// inode-limited tmpfs whose directories the container sees as /tmp,
// /var/tmp, /home and /root.
func (sb *Sandbox) makeDisk(cfg job) error {
	sb.diskMount = filepath.Join(sb.dir, "disk")
	if err := os.Mkdir(sb.diskMount, 0o711); err != nil {
		return err
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=711", cfg.DiskBytes, max(4096, cfg.DiskBytes/8192))
	if err := unix.Mount("tmpfs", sb.diskMount, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount the sandbox disk: %w", err)
	}
	// Owners as the container sees them: through its uid map under runc;
	// gVisor serves files with their host ids as they are.
	host := func(id int) int { return id }
	if !cfg.Runtime.gvisor() {
		host = sb.ids.HostID
	}
	dirs := []struct {
		name string
		mode os.FileMode
		uid  int
	}{{"tmp", os.ModeSticky | 0o777, 0}, {"vartmp", os.ModeSticky | 0o777, 0}, {"home", 0o755, 0},
		{"home/user", 0o750, inside.UserUID}, {"root", 0o700, 0}}
	for _, d := range dirs {
		p := filepath.Join(sb.diskMount, d.name)
		if err := os.Mkdir(p, d.mode); err != nil {
			return err
		}
		if err := os.Chmod(p, d.mode); err != nil {
			return err
		}
		if err := os.Chown(p, host(d.uid), host(d.uid)); err != nil {
			return err
		}
	}
	return nil
}

// run starts the container with the agent's spec on fd 3 and waits for
// the runtime to have started it (detached); setup, when not nil, runs
// first in the runtime's own mount namespace (see runAt).
func (sb *Sandbox) run(ctx context.Context, cfg job, key []byte, setup func() error) error {
	specR, specW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer specR.Close()
	keep := false // a prepared sandbox keeps the spec's pipe for Start
	defer func() {
		if !keep {
			specW.Close()
		}
	}()
	oom, err := os.Open(sb.cg.OOMEventsFile())
	if err != nil {
		return err
	}
	defer oom.Close()
	var tasks *os.File
	if !cfg.Runtime.gvisor() {
		// runc: the workload's own pids group where cgroups can make one
		// (see the process wall); under gVisor every thread is the
		// sentry's. Its events file is the one the agent reads.
		if tasks, err = sb.cg.SplitPids(inside.AgentThreads - 1); err != nil {
			return fmt.Errorf("the workload's pids group: %w", err)
		}
		if tasks != nil {
			defer tasks.Close()
			if err := sb.cg.Apply(cgroups.Limits{Pids: cfg.Limits.Pids}); err != nil {
				return err
			}
		}
	}
	pids, err := os.Open(sb.cg.PidsEventsFile())
	if err != nil {
		return err
	}
	defer pids.Close()
	spec := container.Spec{UserName: inside.UserName,
		AgentUID: inside.AgentUID, Threads: inside.AgentThreads, OOMFD: 4, PidsFD: 5,
		LoopbackUp: !cfg.Runtime.gvisor() && sb.netns == "", LifelineFD: -1, WritableRoot: cfg.Template.Image != nil,
		TrimDev: cfg.Runtime.gvisor(), LockFD: -1}
	for _, v := range cfg.Volumes {
		spec.Volumes = append(spec.Volumes, v.Path)
	}
	files := []*os.File{specR, oom, pids, sb.ids.Held}
	var lifeR *os.File
	if cfg.DieWithCaller {
		// Our end stays open (close-on-exec) for as long as this process
		// lives; the kernel closes it when the process dies.
		var err error
		if lifeR, sb.lifeline, err = os.Pipe(); err != nil {
			return err
		}
		defer lifeR.Close()
		files = append(files, lifeR)
		spec.LifelineFD = 2 + len(files)
	}
	args := cfg.Runtime.flags(sb.netns != "")
	args = append(args, "--root", sb.root, "run", "--detach", "--bundle", filepath.Join(sb.dir, "bundle"),
		"--pid-file", filepath.Join(sb.dir, "pid"))
	var stdin, stdout *os.File
	if cfg.Runtime.gvisor() {
		// The counters ride the agent's standard input and output: runsc
		// restore hands a restored container its standard streams again,
		// and no other descriptor it was passed (see checkpoint.go).
		spec.Channel, spec.ChannelKey = sockInside, key
		spec.OOMFD, spec.PidsFD, spec.LockFD = 0, 1, 4
		stdin, stdout = oom, pids
		files = append([]*os.File{specR, sb.ids.Held}, files[4:]...)
		if lifeR != nil {
			spec.LifelineFD = 2 + len(files)
		}
		for fd := 3; fd < 3+len(files); fd++ {
			args = append(args, "--pass-fd", fmt.Sprintf("%d:%d", fd, fd))
		}
	} else {
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sb.sock, Net: "unix"})
		if err != nil {
			return fmt.Errorf("agent socket: %w", err)
		}
		l.SetUnlinkOnClose(false)
		lf, err := l.File()
		l.Close()
		if err != nil {
			return err
		}
		defer lf.Close()
		// fd 4 is the listener; the others follow it.
		files = append([]*os.File{specR, lf}, files[1:]...)
		spec.OOMFD, spec.PidsFD = 5, 6
		if lifeR != nil {
			spec.LifelineFD = 2 + len(files)
		}
		if tasks != nil {
			files = append(files, tasks)
			spec.WorkloadTasksFD = 2 + len(files)
		}
		args = append(args, "--preserve-fds", strconv.Itoa(len(files))) // fds 3 .. 3+len-1
	}
	// The spec is two documents: what the sandbox is, then what its
	// request says (token, environment), which a prepared sandbox's agent
	// waits for until Start.
	data, _ := json.Marshal(spec)
	if _, err = specW.Write(append(data, '\n')); err != nil {
		return err
	}
	if cfg.prepare {
		keep, sb.specW = true, specW
	} else if err := writeStart(specW, cfg.Spec); err != nil {
		return err
	}
	args = append(args, sb.id)
	cmd := exec.CommandContext(ctx, cfg.Runtime.Binary, args...)
	cmd.ExtraFiles = files
	errR, errW, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = errW, errW
	if stdin != nil {
		cmd.Stdin, cmd.Stdout = stdin, stdout
	}
	go sb.drain(errR)
	nice := 0
	if cfg.prepare && cfg.background && !cfg.Runtime.gvisor() {
		// Not runsc: gVisor's systrap gives every stub thread it makes, for
		// as long as the sandbox lives, the sentry's priority at its first
		// stub plus one, so a sentry started niced would run the tenant's
		// every later thread at nice 16, after the take's renice too.
		nice = backgroundNice
	}
	err = runAt(cmd, nice, setup)
	errW.Close()
	if err != nil {
		time.Sleep(50 * time.Millisecond) // let the drain catch the runtime's last words
		return fmt.Errorf("%s run: %v: %s", filepath.Base(cfg.Runtime.Binary), err, sb.Err())
	}
	return sb.started(filepath.Join(sb.dir, "pid"))
}

// started watches the container whose pid the runtime wrote to pidFile.
func (sb *Sandbox) started(pidFile string) error {
	pidb, err := os.ReadFile(pidFile)
	if err != nil {
		return fmt.Errorf("%s left no pid file: %w", filepath.Base(sb.rt.Binary), err)
	}
	if sb.pid, err = strconv.Atoi(strings.TrimSpace(string(pidb))); err != nil {
		return err
	}
	if sb.pidfd, err = unix.PidfdOpen(sb.pid, 0); err != nil {
		return fmt.Errorf("watch the container: %w", err)
	}
	sb.procDone = make(chan struct{})
	go sb.watch(sb.pidfd, sb.procDone)
	return nil
}

func (sb *Sandbox) drain(r *os.File) {
	defer r.Close()
	buf := make([]byte, 4096)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			sb.mu.Lock()
			sb.stderr = append(sb.stderr, buf[:n]...)
			if len(sb.stderr) > 4096 {
				sb.stderr = append([]byte(nil), sb.stderr[len(sb.stderr)-4096:]...)
			}
			sb.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

// watch waits for the container process (pidfd) to end and closes done;
// the sandbox is gone then, unless a checkpoint stopped it.
func (sb *Sandbox) watch(pidfd int, done chan struct{}) {
	hostproc.WaitPidfd(pidfd)
	close(done)
	sb.mu.Lock()
	stopping := sb.stopping
	sb.mu.Unlock()
	if !stopping {
		sb.setGone()
	}
}

// closePidfd closes the container's pidfd once: whoever comes second
// (a checkpoint's stop, a teardown) finds -1, never a number another
// file of the daemon may have taken since.
func (sb *Sandbox) closePidfd() {
	sb.mu.Lock()
	fd := sb.pidfd
	sb.pidfd = -1
	sb.mu.Unlock()
	if fd >= 0 {
		unix.Close(fd)
	}
}

func (sb *Sandbox) setGone() { sb.gone.Do(func() { close(sb.exited) }) }

// Destroy kills the container and removes everything it had on the host.
func (sb *Sandbox) Destroy() error {
	sb.destroy.Do(func() { sb.destErr = sb.teardown() })
	return sb.destErr
}

func (sb *Sandbox) teardown() error {
	var errs []error
	if sb.ch != nil {
		sb.ch.Close()
	}
	if sb.cg != nil {
		_ = sb.cg.Thaw() // a paused sandbox's init does not die frozen
	}
	if sb.rt != nil {
		rt := func(args ...string) {
			a := append(append([]string{}, sb.rt.Flags...), append([]string{"--root", sb.root}, args...)...)
			_ = exec.Command(sb.rt.Binary, a...).Run()
		}
		rt("kill", sb.id, "KILL")
		sb.mu.Lock()
		running := sb.pidfd >= 0
		if running {
			_ = unix.PidfdSendSignal(sb.pidfd, unix.SIGKILL, nil, 0)
		}
		sb.mu.Unlock()
		if running {
			select {
			case <-sb.procDone:
			case <-time.After(10 * time.Second):
				errs = append(errs, fmt.Errorf("sandbox %s: the container did not exit", sb.id))
			}
			sb.closePidfd()
		}
		rt("delete", "--force", sb.id)
	}
	sb.setGone() // a checkpointed sandbox has no process to end
	if sb.cg != nil {
		errs = append(errs, sb.cg.Destroy())
	}
	// The namespace's pin before the network: then the network's own
	// hold is the last, and the kernel takes the pair as it goes.
	if sb.netns != "" {
		network.RemoveNamespace(sb.netns)
	}
	if sb.net != nil {
		errs = append(errs, sb.net.Close()) // before the slot can be reused
	}
	// The root and disk mounts are detached as the state directory is
	// removed, without following anything the sandbox wrote there.
	if err := state.RemoveTree(sb.dir); err != nil {
		errs = append(errs, err)
	}
	if sb.owner != nil {
		sb.owner.Close()
	}
	if sb.lifeline != nil {
		sb.lifeline.Close()
	}
	if sb.specW != nil {
		sb.specW.Close()
	}
	sb.ids.Release()
	return errors.Join(errs...)
}

// agentCopy returns a read-only copy of the agent binary on a tmpfs of its
// own (rocache.Executable): what a sandbox mounts shows no path of the host.
func agentCopy(runDir, agentPath string) (string, error) {
	return rocache.Executable(filepath.Join(runDir, "agents"), agentPath, "cage-agent")
}

// adopt takes charge again of a running OCI sandbox whose creator is gone:
// its container init is a.PID (started at a.StartTime); the runtime's own state
// and the sandbox's directories are where Create put them.
func adopt(cfg Config, a wall.Adoption) (*Sandbox, error) {
	if st, err := hostproc.StartTime(a.PID); err != nil || st != a.StartTime {
		return nil, fmt.Errorf("sandbox %s: its container (pid %d) is gone", a.ID, a.PID)
	}
	sb := &Sandbox{id: a.ID, token: a.Token, rt: cfg.Runtime, pid: a.PID, exited: make(chan struct{}),
		dir: filepath.Join(cfg.RunDir, "sandboxes", a.ID), root: filepath.Join(cfg.RunDir, cfg.Runtime.Wall),
		cg: cfg.Cgroups.Open(a.ID), log: cfg.Log.With("sandbox", a.ID, "wall", cfg.Runtime.Wall)}
	sb.diskMount, sb.rootfs = filepath.Join(sb.dir, "disk"), filepath.Join(sb.dir, "rootfs")
	sb.sock = filepath.Join(sb.dir, "agent.sock")
	var err error
	if sb.pidfd, err = unix.PidfdOpen(a.PID, 0); err != nil {
		return nil, fmt.Errorf("sandbox %s: pidfd: %w", a.ID, err)
	}
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		unix.Close(sb.pidfd)
		return nil, fmt.Errorf("sandbox %s: %w", a.ID, err)
	}
	if cfg.Runtime.gvisor() {
		// The agent connects again to the channel's socket, made anew.
		if err := sb.adoptChannel(); err != nil {
			sb.owner.Close()
			unix.Close(sb.pidfd)
			return nil, fmt.Errorf("sandbox %s: %w", a.ID, err)
		}
	}
	// The host's lock of its slot died with its creator: take it again
	// (and the sandbox's own, which one restored from a checkpoint does
	// not hold; see checkpoint.go). Taken by another meanwhile only if the
	// sandbox let go of its own: it is adopted all the same.
	if a.Slot >= 0 {
		if sb.ids, err = state.AdoptSlot(a.Slot); err != nil {
			sb.log.Warn("adopted without its slot's lock", "slot", a.Slot, "err", err)
		}
	}
	sb.procDone = make(chan struct{})
	go sb.watch(sb.pidfd, sb.procDone)
	return sb, nil
}
