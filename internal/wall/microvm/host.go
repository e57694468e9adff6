package microvm

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/wall"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall/microvm/guest"
	"github.com/cagehq/cage/internal/wall/state"
)

// Config describes one sandbox to create.
type Config struct {
	// Spec is the sandbox: its Template must be an image; its Limits are
	// the guest's: the guest applies them to a cgroup of its own that holds
	// the agent and every command (so that the exit reasons are its
	// kernel's), and they size the VM: RAM of the memory limit plus
	// GuestOverheadMB, a vCPU per started CPU. QEMU itself runs in a host
	// cgroup (Cgroups) capped by hostMemoryMB. ShmBytes is 64 MiB when 0.
	// Net, with a networked NetPolicy, gives the VM a NIC: a tap in the
	// sandbox's network namespace spliced with its veth (network.AttachTap).
	wall.Spec
	RunDir string
	// Cache keeps what outlives a sandbox (template images, initramfs,
	// snapshots; RunDir/microvm when ""): beside the template store, on
	// disk, since /run is memory on most hosts.
	Cache     string
	AgentPath string // the static cage-agent: the guest's init
	Kernel    *vm.Kernel
	Cgroups   *cgroups.Manager // nil: QEMU gets no cgroup (tests of the VM alone)
	// Accel is "kvm" or "tcg" ("": tcg); see Accel.
	Accel string
	// MemoryMB and CPUs, when set, size the VM instead of Limits.
	MemoryMB int
	CPUs     int
	Log      *slog.Logger // slog.Default() when nil

	coldBoot   bool  // boot, do not restore (tests compare the two)
	prepare    bool  // stop once the guest waits for its spec (prepare.go)
	background bool  // restore at background priority (a pool's; prepare.go)
	fileBytes  int64 // QEMU's bound on the files it writes (0: vm.FileBound; tests lower it)
}

func logger(cfg Config) *slog.Logger {
	if cfg.Log != nil {
		return cfg.Log
	}
	return slog.Default()
}

// GuestOverheadMB is the guest's RAM beyond the sandbox's memory limit:
// its kernel, the initramfs (the agent) and the page cache of the image.
// Pages the guest never touches cost the host nothing.
const GuestOverheadMB = 128

// QEMUOverheadMB is QEMU's own memory beyond the guest's RAM: measured
// at 89 MiB under TCG with the guest's RAM in use (its binary and
// libraries 22 MiB, TCG's translation cache up to tcgCacheMB, its heap).
const QEMUOverheadMB = 64 + 64

// hostMemoryMB is the memory limit of the host cgroup of a VM of memMB:
// its RAM twice, and QEMU's overhead. A restored VM's first touch of a
// page of the snapshot's memfd that holds no data yet puts a page into the
// memfd (shared with every later VM, charged to this one) before the
// private copy the guest writes to: at most the RAM again, which stays
// shared, while what the VM holds alone stays within RAM + overhead.
func hostMemoryMB(memMB int) int64 { return int64(2*memMB + QEMUOverheadMB) }

// qemuPids bounds QEMU's threads: vCPUs, the main loop, RCU, and its
// block I/O workers.
const qemuPids = 128

// vmSize is the VM shape of cfg: RAM and vCPUs. RAM from a memory limit
// is rounded up to a size class (memClass); the guest's cgroup holds the
// sandbox to its limit exactly.
func vmSize(cfg Config) (memMB, cpus int) {
	memMB, cpus = cfg.MemoryMB, cfg.CPUs
	if memMB == 0 {
		memMB = 256
		if cfg.Limits.MemoryBytes > 0 {
			memMB = memClass(int((cfg.Limits.MemoryBytes+(1<<20)-1)>>20) + GuestOverheadMB)
		}
	}
	if cpus == 0 {
		cpus = max(1, int(math.Ceil(cfg.Limits.CPUs)))
	}
	return memMB, cpus
}

// memClass rounds a VM's RAM up to a size class: a multiple of 64 MiB
// below 1 GiB, of 256 MiB below 8 GiB, of 1 GiB above. Each shape of VM
// has a snapshot of its own, on disk and loaded into the daemon's memory
// (some 100 MB each), made by a cold boot: with RAM to the MiB of each
// request's limit, a tenant asking for 512, 513, 514... MiB made one per
// request, without bound.
func memClass(mb int) int {
	step := 64
	switch {
	case mb > 8<<10:
		step = 1 << 10
	case mb > 1<<10:
		step = 256
	}
	return (mb + step - 1) / step * step
}

// Sandbox is a running microvm sandbox, seen from the host.
type Sandbox struct {
	id, token string
	dir       string
	v         *vm.VM
	sess      *yamux.Session
	restored  bool // from a snapshot, not booted cold
	owner     *os.File
	ids       *state.IDRange
	net       *network.Sandbox
	netns     string
	tap       *os.File
	cg        *cgroups.Cgroup
	prep      *preparation // made ahead of its request (prepare.go); nil when not
	destroy   sync.Once
	destroyed chan struct{}

	// For checkpoints (checkpoint.go): what the VM was made of, and the
	// sandbox's end, which a checkpoint's stop of QEMU is not.
	cfg      Config
	vcfg     vm.Config
	exited   chan struct{}
	gone     sync.Once
	mu       sync.Mutex
	stopping bool // QEMU is stopped on purpose (a checkpoint)
}

// ID is the sandbox's id.
func (sb *Sandbox) ID() string { return sb.id }

// Token is the agent's access token.
func (sb *Sandbox) Token() string { return sb.token }

// Dial opens a connection to the agent: a stream of the session.
func (sb *Sandbox) Dial(ctx context.Context) (net.Conn, error) {
	sb.mu.Lock()
	sess := sb.sess // none while a checkpoint is restored, or after one failed
	sb.mu.Unlock()
	if sess == nil {
		return nil, fmt.Errorf("sandbox %s is not running", sb.id)
	}
	c, err := sess.Open()
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", sb.id, err)
	}
	return c, nil
}

// Wall is "microvm".
func (sb *Sandbox) Wall() string { return "microvm" }

// AgentPID is QEMU's host pid: the sandbox lives as long as it does.
func (sb *Sandbox) AgentPID() int { return sb.v.Pid() }

// Exited is closed once the sandbox has ended: its VM ended (not stopped
// for a checkpoint), or it was destroyed.
func (sb *Sandbox) Exited() <-chan struct{} { return sb.exited }

// watchVM ends the sandbox when v ends, unless a checkpoint stopped it.
func (sb *Sandbox) watchVM(v *vm.VM) {
	<-v.Exited()
	sb.mu.Lock()
	stopping := sb.stopping
	sb.mu.Unlock()
	if !stopping {
		sb.setGone()
	}
}

func (sb *Sandbox) setGone() { sb.gone.Do(func() { close(sb.exited) }) }

// Err says why the VM ended, once Exited is closed.
func (sb *Sandbox) Err() error {
	select {
	case <-sb.destroyed:
		return errors.New("destroyed")
	default:
	}
	if err := sb.v.Wait(); err != nil {
		return err
	}
	return fmt.Errorf("the guest powered off (%s)", consoleTail(sb.v))
}

// Cgroup is QEMU's host cgroup (nil without one).
func (sb *Sandbox) Cgroup() *cgroups.Cgroup { return sb.cg }

// DiskPath is "": the sandbox's disk is inside the guest.
func (sb *Sandbox) DiskPath() string { return "" }

// Network is the sandbox's network, nil when it has none.
func (sb *Sandbox) Network() *network.Sandbox { return sb.net }

// attachNetwork makes the sandbox's network namespace with its veth and
// the tap the VM's NIC is backed by.
func (sb *Sandbox) attachNetwork(cfg Config) error {
	sb.netns = filepath.Join(sb.dir, "netns")
	if err := network.NewNamespace(sb.netns); err != nil {
		sb.netns = ""
		return fmt.Errorf("sandbox network namespace: %w", err)
	}
	ns, err := os.Open(sb.netns)
	if err != nil {
		return err
	}
	defer ns.Close()
	if sb.net, err = cfg.Net.Attach(sb.id, sb.ids.Slot(), int(ns.Fd()), cfg.NetPolicy); err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	if sb.tap, err = network.AttachTap(int(ns.Fd())); err != nil {
		return fmt.Errorf("sandbox network: %w", err)
	}
	return nil
}

// Destroy stops the VM and removes everything it had on the host: QEMU,
// its cgroup, its uid range and its directory.
func (sb *Sandbox) Destroy() (err error) {
	sb.destroy.Do(func() {
		sb.traceBlocks("microvm: destroy")
		close(sb.destroyed)
		err = sb.release()
		sb.ids.Release()
		sb.setGone()
	})
	return err
}

// release stops the VM and removes what it had on the host, but for its
// uid range (and network slot): a checkpointed sandbox keeps those.
func (sb *Sandbox) release() (err error) {
	if sb.sess != nil {
		sb.sess.Close()
	}
	if sb.cg != nil {
		_ = sb.cg.Thaw() // a paused QEMU does not die frozen
	}
	if sb.v != nil {
		sb.v.Stop()
	}
	if sb.cg != nil {
		err = sb.cg.Destroy()
		sb.cg = nil
	}
	if sb.tap != nil {
		sb.tap.Close()
		sb.tap = nil
	}
	// The namespace's pin before the network: then the network's own
	// hold is the last, and the kernel takes the pair as it goes.
	if sb.netns != "" {
		network.RemoveNamespace(sb.netns)
		sb.netns = ""
	}
	if sb.net != nil {
		if nerr := sb.net.Close(); err == nil {
			err = nerr
		}
		sb.net = nil
	}
	if rerr := state.RemoveTree(sb.dir); err == nil {
		err = rerr
	}
	if sb.owner != nil {
		sb.owner.Close()
		sb.owner = nil
	}
	return err
}

// Create starts a sandbox's VM and its agent. The VM is restored from the
// snapshot of its shape, made by the first Create of that shape; a VM
// boots cold only if the snapshot cannot be made. On error nothing is
// left behind.
func Create(ctx context.Context, cfg Config) (sb *Sandbox, err error) {
	if cfg.Template == nil || cfg.Template.Image == nil {
		return nil, errors.New("the microvm wall runs image templates only (not host)")
	}
	sb = newSandbox(cfg)
	defer func() {
		if errors.Is(err, state.ErrInUse) {
			sb.ids.Release() // the directory and all in it are another's
			sb = nil
		} else if err != nil {
			_ = sb.Destroy()
			sb = nil
		}
	}()
	// QEMU runs as the first uid of a range of its own, which owns nothing
	// on the host, in namespaces of its own (vm's jail).
	if sb.ids, err = state.ReserveIDs(); err != nil {
		return sb, err
	}
	if err := sb.vmConfig(); err != nil {
		return sb, err
	}
	if err := sb.setUp(); err != nil {
		return sb, err
	}
	vcfg, cache := sb.vcfg, cacheDir(cfg)
	trace.Mark("microvm: restore")
	if !cfg.coldBoot {
		snap, serr := cachedSnapshot(ctx, cache, vcfg)
		var mem *os.File
		var release func()
		if serr == nil {
			mem, release, serr = snap.memory(cfg.Template)
		}
		if serr == nil {
			rc := vcfg
			rc.MemoryFD = mem
			rc.Background = cfg.background
			if cfg.background && sb.cg != nil {
				// QEMU's restore and warm-up, a pool's refill, yield
				// to the sandboxes running, until Foreground. Not
				// before the snapshot is there: its build, in this
				// group too, is what a create of the same shape waits
				// for. Nor at a checkpoint's restore, whose setUp
				// makes a group anew.
				err = sb.cg.SetBackground(true)
			}
			if err == nil {
				sb.v, err = vm.Restore(ctx, rc, snap.state())
			}
			// QEMU has its own descriptor of the memory now (or will
			// never have one): the host's hold on it ends.
			release()
			if err != nil {
				return sb, err
			}
			sb.restored = true
		} else {
			if ctx.Err() != nil {
				return sb, ctx.Err()
			}
			logger(cfg).Warn("microvm: no snapshot, booting cold", "sandbox", cfg.ID, "err", serr)
		}
	}
	if sb.v == nil {
		if sb.v, err = vm.Start(ctx, vcfg); err != nil {
			return sb, err
		}
	}
	go sb.watchVM(sb.v)
	trace.Mark("microvm: running")
	gctx, cancel := context.WithTimeout(ctx, greetTimeout)
	sb.sess, err = greet(gctx, sb.v)
	cancel()
	if err != nil {
		return sb, err
	}
	go nudge(sb.sess, sb.reportStall)
	sb.traceBlocks("microvm: greeted")
	if cfg.prepare {
		return sb, sb.prepared()
	}
	return sb, sb.start(ctx, cfg.Spec)
}

// start sends the guest its spec (its identity, limits and network) and
// waits for its agent to serve.
func (sb *Sandbox) start(ctx context.Context, spec wall.Spec) error {
	var gnet *guest.Net
	if sb.net != nil {
		gnet = &guest.Net{IP: sb.net.IP, Gateway: spec.Net.Gateway(), ResolvConf: spec.Net.ResolvConf()}
	}
	first, err := sb.sess.Open()
	if err != nil {
		return err
	}
	defer first.Close()
	hostname := spec.Hostname
	if hostname == "" {
		hostname = ids.Hostname(spec.ID)
	}
	// Every guest gets its own random bytes and the time, restored or not:
	// see spec.
	entropy := make([]byte, guest.EntropyBytes)
	if _, err := rand.Read(entropy); err != nil {
		return err
	}
	if err := json.NewEncoder(first).Encode(guest.Spec{Token: spec.Token, Env: spec.Env, MaxOutput: spec.MaxOutput,
		Hostname: hostname, DiskBytes: spec.DiskBytes, ShmBytes: shmBytes(spec.ShmBytes), Threads: inside.AgentThreads, Limits: spec.Limits, Net: gnet,
		Entropy: entropy, UnixNano: time.Now().UnixNano(), Trace: trace.On()}); err != nil {
		return err
	}
	if err := readLine(ctx, first, bufio.NewReader(first), guest.Ready); err != nil {
		return fmt.Errorf("the guest's agent did not start: %w (%s%s)", err, consoleTail(sb.v), qemuEnd(sb.v))
	}
	sb.traceBlocks("microvm: ready")
	if trace.On() {
		// The guest's marks (its clock is the host's, set by the spec,
		// but runs slow under TCG), quoted: the guest writes its console.
		for _, l := range strings.Split(sb.v.Console(), "\n") {
			if strings.HasPrefix(l, "trace ") {
				trace.Mark("guest console: " + strconv.Quote(strings.TrimSpace(l)))
			}
		}
	}
	return nil
}

// TranslatedBlocks is how many blocks of guest code TCG has translated in
// the sandbox's QEMU so far (0 under KVM; see vm.TranslatedBlocks).
func (sb *Sandbox) TranslatedBlocks(ctx context.Context) (int, error) {
	return sb.v.TranslatedBlocks(ctx)
}

// traceBlocks marks a phase of the sandbox's life in the trace with the
// blocks of guest code TCG has translated so far in its QEMU (a QMP round
// trip, taken before the mark's time): under TCG a restored guest spends
// its time translating what it runs for the first time since QEMU
// started, so the counts between marks say where it goes.
func (sb *Sandbox) traceBlocks(what string) {
	if !trace.On() || sb.v == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := sb.v.TranslatedBlocks(ctx)
	if err != nil {
		trace.Mark(what + " (translated blocks not known: " + err.Error() + ")")
		return
	}
	trace.Mark(what + " (" + strconv.Itoa(n) + " blocks translated)")
}

// greetTimeout bounds the wait for a restored (or booted) guest's hello:
// a guest that never says it (seen once under a load of 15 on 2 cores,
// the hello lost around its snapshot) fails the create rather than hang
// it.
const greetTimeout = 60 * time.Second

func newSandbox(cfg Config) *Sandbox {
	return &Sandbox{id: cfg.ID, token: cfg.Token, dir: filepath.Join(cfg.RunDir, "sandboxes", cfg.ID),
		destroyed: make(chan struct{}), exited: make(chan struct{}), cfg: cfg}
}

func cacheDir(cfg Config) string {
	if cfg.Cache == "" {
		return filepath.Join(cfg.RunDir, "microvm")
	}
	return cfg.Cache
}

// vmConfig sets sb.vcfg: the VM of sb.cfg, as QEMU (jailed as sb.ids'
// first uid) runs it; its tap and jail come with setUp.
func (sb *Sandbox) vmConfig() error {
	cfg := sb.cfg
	cache := cacheDir(cfg)
	initrd, err := Initramfs(cache, cfg.Kernel, cfg.AgentPath)
	if err != nil {
		return err
	}
	disk, err := TemplateImage(cache, cfg.Template)
	if err != nil {
		return err
	}
	memMB, cpus := vmSize(cfg)
	sb.vcfg = vm.Config{Kernel: cfg.Kernel, Initramfs: initrd, MemoryMB: memMB, CPUs: cpus, Accel: cfg.Accel,
		Dir: filepath.Join(sb.dir, "vm"), Disks: []string{disk}, Credential: credential(sb.ids, cfg.Accel),
		Jailer: cfg.AgentPath, Append: guestArgsFor(cfg.Accel), FileBytes: cfg.fileBytes}
	if cfg.Net != nil && cfg.NetPolicy.Networked() {
		sb.vcfg.MAC = network.GuestMAC
	}
	return nil
}

// setUp makes what the VM needs on the host: the sandbox's directory and
// owner lock, its network (in sb.ids' slot) with the tap of its NIC, and
// QEMU's cgroup; and puts the tap and the cgroup into sb.vcfg.
func (sb *Sandbox) setUp() error {
	cfg := sb.cfg
	// Traversable, as on the other walls (QEMU needs none of it: it gets
	// its sockets and files as descriptors, in a jail of its own).
	for _, d := range []string{cfg.RunDir, filepath.Dir(sb.dir)} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return err
		}
		if err := os.Chmod(d, 0o711); err != nil {
			return err
		}
	}
	if err := state.MakeDir(sb.dir, 0o711); err != nil {
		return err
	}
	var err error
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		return err
	}
	sb.vcfg.Tap, sb.vcfg.Jail = nil, nil
	if cfg.Net != nil && cfg.NetPolicy.Networked() {
		if err := sb.attachNetwork(cfg); err != nil {
			return err
		}
		sb.vcfg.Tap = sb.tap
	}
	if cfg.Cgroups != nil {
		if sb.cg, err = cfg.Cgroups.Create(cfg.ID, cgroups.Limits{MemoryBytes: hostMemoryMB(sb.vcfg.MemoryMB) << 20,
			CPUs: float64(sb.vcfg.CPUs), Pids: qemuPids}); err != nil {
			return fmt.Errorf("cgroup: %w", err)
		}
		sb.vcfg.Jail = sb.cg.AddProc
	}
	return nil
}

func shmBytes(n int64) int64 {
	if n <= 0 {
		return 64 << 20
	}
	return n
}

// guestArgs are the microvm wall's additions to the guest kernel's
// command line. Sandboxes have no IPv6, on any wall. The guest's own
// speculation mitigations are off: they keep the guest's processes from
// one another, all of which are the one sandbox's, and cost much under
// TCG; what stands between sandboxes, and between a sandbox and the host,
// is the VM, whose mitigations are the host kernel's.
const guestArgs = "ipv6.disable=1 mitigations=off"

// tcgArgs are added under TCG: no address-space randomization in the
// guest. TCG keeps its translations of guest code by the code's virtual
// address, so with randomization every exec maps the dynamic loader, libc
// and each position-independent program at new addresses and QEMU
// translates all of it anew (measured: 10 execs of echo from bash in a warm
// guest 0.76-0.98 s with it, 0.16-0.23 s without). Under TCG the wall is
// for development and CI and says it is not a security boundary; under
// KVM, whose guests run their code natively, randomization stays.
const tcgArgs = "norandmaps"

// guestArgsFor is the guest's command line additions under accel ("" is
// TCG). They are part of the snapshot's shape, so a snapshot made under
// other ones is never restored.
func guestArgsFor(accel string) string {
	if accel == "kvm" {
		return guestArgs
	}
	return guestArgs + " " + tcgArgs
}

// credential is QEMU's: the first uid and gid of ids, and no other group
// but /dev/kvm's under KVM.
func credential(ids *state.IDRange, accel string) *syscall.Credential {
	c := &syscall.Credential{Uid: uint32(ids.Base), Gid: uint32(ids.Base), Groups: []uint32{}}
	if accel == "kvm" {
		var st unix.Stat_t
		if unix.Stat("/dev/kvm", &st) == nil {
			c.Groups = append(c.Groups, st.Gid)
		}
	}
	return c
}

// readLine reads one line from r and checks it is want.
func readLine(ctx context.Context, c net.Conn, r *bufio.Reader, want string) error {
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetReadDeadline(dl)
		defer c.SetReadDeadline(time.Time{})
	}
	line, err := readLineMax(r, maxGuestLine)
	if err != nil {
		return err
	}
	if line != want {
		return fmt.Errorf("%s", strings.TrimSpace(line))
	}
	return nil
}

// maxGuestLine bounds a line the host reads from a guest before its
// session (a readiness word, or one line of error).
const maxGuestLine = 64 << 10

// readLineMax reads one line of at most max bytes: a guest (hostile, or
// its agent taken over) that sends one without end is refused, not
// buffered until the deadline.
func readLineMax(r *bufio.Reader, max int) (string, error) {
	var line []byte
	for {
		frag, err := r.ReadSlice('\n')
		if len(line)+len(frag) > max {
			return "", fmt.Errorf("a line of more than %d bytes from the guest", max)
		}
		line = append(line, frag...)
		if err == bufio.ErrBufferFull {
			continue
		}
		return string(line), err
	}
}

// qemuEnd says how QEMU ended, if it has within a moment.
func qemuEnd(v *vm.VM) string {
	select {
	case <-v.Exited():
		if err := v.Wait(); err != nil {
			return "; " + err.Error()
		}
		return "; qemu exited"
	case <-time.After(500 * time.Millisecond):
		return ""
	}
}

// consoleTail is the last lines of the guest's console, for errors.
func consoleTail(v *vm.VM) string {
	lines := strings.Split(strings.TrimSpace(v.Console()), "\n")
	return "console: " + strings.Join(lines[max(0, len(lines)-3):], " | ")
}

// Initramfs returns the guest's initramfs for kernel k with the agent as
// init, built once per agent binary and kernel into dir.
func Initramfs(dir string, k *vm.Kernel, agentPath string) (string, error) {
	sum, err := fileSum(agentPath)
	if err != nil {
		return "", err
	}
	name := "initramfs-" + k.Version + "-" + sum[:16] + ".cpio"
	p := filepath.Join(dir, name)
	if _, err := os.Stat(p); err == nil {
		return p, os.Chmod(p, 0o644) // made by an older cage, 0600
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(dir, ".initramfs-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	modules := append(append([]string(nil), vm.DefaultModules...), "ext4", "overlay")
	err = vm.WriteInitramfs(f, k, agentPath, modules)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	// 0644 in a 0700 directory: QEMU, an unprivileged uid, reads it only
	// through the descriptor it inherits.
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return "", err
	}
	return p, os.Rename(f.Name(), p)
}

// fileSums keeps each file's sum by its identity (device, inode, size,
// modification time): every create names the initramfs by the agent's sum,
// and reading the agent (megabytes) once per process is enough.
var fileSums sync.Map

func fileSum(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return "", err
	}
	key := [4]int64{int64(st.Dev), int64(st.Ino), st.Size, st.Mtim.Nano()}
	if sum, ok := fileSums.Load(key); ok {
		return sum.(string), nil
	}
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	sum := hex.EncodeToString(h.Sum(nil))
	fileSums.Store(key, sum)
	return sum, nil
}

// TemplateImage returns the read-only ext4 image of template t's files,
// built once per template ID into dir: its layers merged by a read-only
// overlay on the host, copied by mke2fs -d (owners and modes kept).
func TemplateImage(dir string, t *template.Template) (string, error) {
	p := filepath.Join(dir, "images", t.Image.Info.ID[len("sha256:"):][:24]+".ext4")
	if _, err := os.Stat(p); err == nil {
		return p, os.Chmod(p, 0o644) // made by an older cage, 0600
	}
	// One build per image at a time in this process; the others wait
	// and take its file.
	mu, _ := snapshotLocks.LoadOrStore("image "+p, new(sync.Mutex))
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return "", err
	}
	unlock, err := t.Image.Store.RLock()
	if err != nil {
		return "", err
	}
	defer unlock()
	layers, err := t.Image.Store.LayerDirs(t.Image.Info)
	if err != nil {
		return "", err
	}
	merged, err := os.MkdirTemp(dir, ".merged-")
	if err != nil {
		return "", err
	}
	defer os.Remove(merged)
	if len(layers) == 1 {
		err = unix.Mount(layers[0], merged, "", unix.MS_BIND|unix.MS_RDONLY, "")
	} else {
		var top []string
		for i := len(layers) - 1; i >= 0; i-- {
			top = append(top, layers[i])
		}
		err = unix.Mount(imgstore.MountSource(t.Image.Info), merged, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(top, ":"))
	}
	if err != nil {
		return "", fmt.Errorf("merge the template's layers: %w", err)
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	// Size: the files plus a third, at least 64 MiB; inodes: one per file
	// and some.
	size := max(64<<20, t.Image.Info.Size*4/3+32<<20)
	// A name of its own: two creates (in this process or another sharing
	// the cache) building the same image at once each write their own
	// file, and the second rename replaces the first with equal bytes.
	f, err := os.CreateTemp(filepath.Dir(p), ".image-*.ext4")
	if err != nil {
		return "", err
	}
	tmp := f.Name()
	f.Close()
	out, err := exec.Command("mke2fs", "-q", "-t", "ext4", "-O", "^has_journal", "-m", "0", "-E", "root_owner=0:0",
		"-d", merged, tmp, strconv.FormatInt(size/1024, 10)+"k").CombinedOutput()
	if err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("mke2fs: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Chmod(tmp, 0o644); err != nil { // as Initramfs's
		_ = os.Remove(tmp)
		return "", err
	}
	if err := os.Rename(tmp, p); err != nil {
		_ = os.Remove(tmp)
		return "", err
	}
	return p, nil
}
