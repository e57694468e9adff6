package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/vm/boot"
)

// QEMU is the emulator Start runs.
const QEMU = "qemu-system-x86_64"

// Sockets in a VM's directory, made by the host and handed to QEMU as
// listening descriptors: QEMU needs no path of the host's.
const (
	AgentSocket = "agent.sock" // the host end of the agent port
	QMPSocket   = "qmp.sock"   // QEMU's machine protocol, for control
)

// Config describes one VM.
type Config struct {
	Kernel    *Kernel
	Initramfs string // from WriteInitramfs
	MemoryMB  int    // 256 when 0
	CPUs      int    // 1 when 0
	Accel     string // "tcg" (the default) or "kvm"
	// Dir is a directory of the host's for the VM's sockets (made root's,
	// 0700: QEMU gets the sockets as descriptors and never sees it).
	Dir    string
	Append string // more of the kernel's command line
	// Disks are raw images the guest sees read-only, as /dev/vda, vdb, ...
	// in this order.
	Disks []string
	// MemoryFile, when set, holds the guest's RAM (a memory-backend-file)
	// instead of anonymous memory: the RAM of a VM to snapshot, mapped
	// shared so the file is the RAM and the snapshot's state file need not
	// carry it, or the RAM a VM is restored from, mapped private
	// (ShareMemory false) so that every VM restored from one file reads the
	// file's pages from the page cache and copies only those it writes.
	MemoryFile  string
	ShareMemory bool
	// MemoryFD, when set, is the RAM a VM is restored from, in place of
	// MemoryFile: a descriptor QEMU inherits (a sealed memfd, which QEMU
	// may open for writing as QEMU 7.2 insists but can never write to).
	// QEMU holds a descriptor of its own once Restore returns: the caller
	// may then close it.
	MemoryFD *os.File
	// NamedRAM, with neither MemoryFile nor MemoryFD, puts the RAM in an
	// anonymous memory backend named as the file-backed one is: the RAM
	// of a VM resumed from a checkpoint of a VM whose RAM was a file
	// (a migration matches RAM by its name).
	NamedRAM bool

	// Tap, when set, backs the VM's NIC (virtio-net, MAC address MAC): a
	// tap device's descriptor, opened with IFF_VNET_HDR.
	Tap *os.File
	MAC string

	// Credential, when set, is who QEMU runs as: an unprivileged uid of
	// the VM's own, jailed (jail.go) by Jailer, cage-agent. Every file
	// QEMU reads is then opened by the caller and inherited (Args names it
	// /proc/self/fd/N), so that QEMU needs no path to it.
	Credential *syscall.Credential
	Jailer     string
	// FileBytes bounds, in the jail, every regular file QEMU writes
	// (RLIMIT_FSIZE): its snapshot's RAM file and state, a checkpoint.
	// 0 is FileBound of the VM's RAM. A write past it fails (EFBIG): a
	// checkpoint past it fails and the VM runs on.
	FileBytes int64
	// Jail, when set, runs once QEMU exists and before the guest runs
	// (QEMU starts paused): to put it into its cgroup.
	Jail func(pid int) error
	// Background starts QEMU, and so its every thread, at BackgroundNice
	// until Foreground (a VM made ahead of its request).
	Background bool

	incoming bool              // start paused, waiting for a migration (Restore)
	paused   bool              // start paused (-S), for Jail
	fdPaths  map[string]string // files passed as descriptors: path -> /proc/self/fd/N
	tapFD    int               // the tap's descriptor number in QEMU
	qmpFD    int               // QMP's listening socket in QEMU
	agentFD  int               // the agent port's listening socket in QEMU
}

// FileBound is the most an honest QEMU writes into one file for a VM of
// memMB of RAM: a checkpoint, the largest, is the RAM (a page's header of
// 8 bytes for every 4 KiB sent; zero pages as a header and a byte), the
// firmware's and ACPI tables' RAM (some MiB at most) and the devices'
// and CPUs' state (tens of KiB); a snapshot's RAM file is the RAM. The
// margin is a sixty-fourth of the RAM and 64 MiB.
func FileBound(memMB int) int64 {
	ram := int64(memMB) << 20
	return ram + ram/64 + 64<<20
}

// fileBytes is cfg.FileBytes, or FileBound of its RAM.
func (cfg Config) fileBytes() int64 {
	if cfg.FileBytes > 0 {
		return cfg.FileBytes
	}
	return FileBound(cfg.memoryMB())
}

// memoryMB is the VM's RAM in MiB.
func (cfg Config) memoryMB() int {
	if cfg.MemoryMB <= 0 {
		return 256
	}
	return cfg.MemoryMB
}

// memFDKey names Config.MemoryFD among the files passed to QEMU.
const memFDKey = "\x00memory"

// tcgCacheMB bounds TCG's translation cache (QEMU 7.2's default is a
// gigabyte of host memory per VM, reserved lazily but charged as used).
const tcgCacheMB = 64

// path is how QEMU names file p: the descriptor it inherits, if any.
func (cfg Config) path(p string) string {
	if fp, ok := cfg.fdPaths[p]; ok {
		return fp
	}
	return p
}

// VM is a running QEMU.
type VM struct {
	cfg      Config
	cmd      *exec.Cmd
	stderr   *tail
	console  *tail         // the guest's console, its last ConsoleBytes
	lifeline *os.File      // the jailer's lifeline (nil without a jail)
	done     chan struct{} // closed once QEMU has been reaped
	err      error         // how QEMU ended, set before done is closed
	stop     sync.Once
}

// kernelArgs come first on the guest's command line. console=ttyS0 with
// microvm's ISA serial port: the 8250 driver is built in, so the console
// works from the kernel's first line to a panic before any module is
// loaded (a virtio console would start only with its module). "quiet" keeps
// the emulated serial port nearly silent; panic=-1 turns a panic into a
// reboot, which -no-reboot turns into QEMU's exit. reboot=t restarts by a
// triple fault, which stops the CPU at once: Linux's default, the ACPI reset
// register, is a request QEMU acts on a moment later, and meanwhile Linux
// tries its next ways, down to jumping into the firmware itself, which now
// and then (about one in five here) boots the guest again instead of
// ending QEMU. cryptomgr.notests skips the crypto self-tests, the longest
// step of the kernel's boot under TCG (about half a second).
const kernelArgs = "console=ttyS0 quiet panic=-1 reboot=t cryptomgr.notests"

// Args returns QEMU's command line for cfg (without the program name).
func (cfg Config) Args() []string {
	mem, cpus, accel := cfg.MemoryMB, cfg.CPUs, cfg.Accel
	if mem == 0 {
		mem = 256
	}
	if cpus == 0 {
		cpus = 1
	}
	if accel == "" {
		accel = "tcg"
	}
	image := ""
	if cfg.Kernel != nil {
		image = cfg.Kernel.Image()
	}
	cmdline := kernelArgs
	if khz := hostTSCkHz(); accel == "tcg" && khz != 0 {
		// See hostTSCkHz. Under KVM the guest learns it from kvm-clock.
		cmdline += " tsc_early_khz=" + strconv.FormatUint(khz, 10)
	}
	if cfg.Append != "" {
		cmdline += " " + cfg.Append
	}
	machine := "microvm,acpi=on,pit=off,pic=off,rtc=on,isa-serial=on,auto-kernel-cmdline=off"
	accelArg := accel
	if accel == "tcg" {
		accelArg += ",tb-size=" + strconv.Itoa(tcgCacheMB)
	}
	var memArgs []string
	if cfg.MemoryFD != nil {
		machine += ",memory-backend=mem"
		memArgs = []string{"-object", "memory-backend-file,id=mem,size=" + strconv.Itoa(mem) + "M,mem-path=" + optValue(cfg.path(memFDKey)) + ",share=off"}
	} else if cfg.MemoryFile == "" && cfg.NamedRAM {
		machine += ",memory-backend=mem"
		memArgs = []string{"-object", "memory-backend-ram,id=mem,size=" + strconv.Itoa(mem) + "M"}
	} else if cfg.MemoryFile != "" {
		share := "off"
		if cfg.ShareMemory {
			share = "on"
		}
		machine += ",memory-backend=mem"
		memArgs = []string{"-object", "memory-backend-file,id=mem,size=" + strconv.Itoa(mem) + "M,mem-path=" + optValue(cfg.path(cfg.MemoryFile)) + ",share=" + share}
	}
	args := []string{
		// microvm: no PCI, no firmware tables but ACPI's, no legacy devices
		// but those asked for. ACPI tells the guest where the virtio-mmio
		// devices are. No PIT and no PIC: the guest uses the local APIC's
		// timer and the I/O APIC, and the PIT's interrupts are what an
		// uncalibrated boot under TCG waits for in vain. An RTC for the
		// wall clock, the ISA serial port for the console, and no
		// virtio-mmio devices added to the command line, which Debian's
		// kernel would only warn about.
		"-M", machine,
		"-accel", accelArg,
		"-nodefaults", "-no-user-config", "-nographic",
		// QEMU's own seccomp filter: no old syscalls, no setuid, no
		// spawning, no changing of scheduling or affinity.
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-m", strconv.Itoa(mem),
	}
	args = append(args, memArgs...)
	args = append(args,
		"-smp", strconv.Itoa(cpus),
		"-kernel", cfg.path(image),
		"-initrd", cfg.path(cfg.Initramfs),
		"-append", cmdline,
		// The console is QEMU's standard output, which the host reads
		// into a bounded buffer (Console).
		"-chardev", "stdio,id=console,signal=off",
		"-serial", "chardev:console",
		"-device", "virtio-serial-device,max_ports=2",
		"-chardev", "socket,id=agent,fd="+strconv.Itoa(cfg.agentFD)+",server=on,wait=off",
		"-device", "virtserialport,chardev=agent,name="+boot.AgentPort,
		"-chardev", "socket,id=qmp,fd="+strconv.Itoa(cfg.qmpFD)+",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		"-no-reboot",
	)
	if cfg.Tap != nil {
		args = append(args, "-netdev", "tap,id=net0,vhost=off,fd="+strconv.Itoa(cfg.tapFD),
			"-device", "virtio-net-device,netdev=net0,mac="+cfg.MAC)
	}
	for i, d := range cfg.Disks {
		id := "disk" + strconv.Itoa(i)
		args = append(args, "-drive", "file="+optValue(cfg.path(d))+",format=raw,if=none,readonly=on,id="+id,
			"-device", "virtio-blk-device,drive="+id)
	}
	if cfg.incoming {
		// Wait for migrate-incoming on QMP, which can take a descriptor
		// (the command line cannot without a shell to spawn).
		args = append(args, "-incoming", "defer")
	} else if cfg.paused {
		args = append(args, "-S")
	}
	return args
}

// optValue escapes a value inside one of QEMU's option lists, where a
// comma would end it.
func optValue(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// maxSocketPath is what fits in a unix socket address (with its NUL).
const maxSocketPath = 107

// Start runs QEMU for cfg and returns once the VM runs; the guest boots on
// in the background (DialAgent waits for it). ctx bounds only the start:
// the VM runs until Stop or its own end, or until the thread that started
// it ends (QEMU's parent-death signal is tied to that thread, so do not
// call Start from a goroutine that locks its thread and then exits).
func Start(ctx context.Context, cfg Config) (*VM, error) {
	cfg.incoming = false
	cfg.paused = cfg.Jail != nil
	v, err := launch(cfg)
	if err != nil {
		return nil, fmt.Errorf("start vm: %w", err)
	}
	// QEMU answers on QMP from its main loop only once the machine is
	// built and running: a bad option, too much memory or a kernel it
	// cannot load, and a refused accelerator end Start, not a later dial.
	if err := v.start(ctx); err != nil {
		v.Stop()
		return nil, fmt.Errorf("start vm: %w", err)
	}
	return v, nil
}

// start jails a QEMU started paused and lets it run, or waits for one
// started running.
func (v *VM) start(ctx context.Context) error {
	q, err := v.qmp(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	if v.cfg.paused {
		if err := v.cfg.Jail(v.Pid()); err != nil {
			return err
		}
		if _, err := q.call(ctx, "cont", nil); err != nil {
			return v.qemuGone(ctx, err)
		}
	}
	return v.checkRunning(ctx, q)
}

// launch checks cfg and starts QEMU.
func launch(cfg Config) (*VM, error) {
	if err := checkConfig(cfg); err != nil {
		return nil, err
	}
	bin, err := exec.LookPath(QEMU)
	if err != nil {
		return nil, fmt.Errorf("%s not found; run scripts/kernel.sh (installs qemu-system-x86)", QEMU)
	}
	var files []*os.File
	defer func() {
		for _, f := range files {
			if f != cfg.MemoryFD && f != cfg.Tap {
				f.Close()
			}
		}
	}()
	pass := func(f *os.File) int {
		files = append(files, f)
		return 2 + len(files)
	}
	socks, err := listenSockets(cfg.Dir)
	if err != nil {
		return nil, err
	}
	cfg.qmpFD, cfg.agentFD = pass(socks[0]), pass(socks[1])
	if cfg.Tap != nil {
		cfg.tapFD = pass(cfg.Tap)
	}
	if cfg.Credential != nil {
		cfg.fdPaths = map[string]string{}
		paths := append([]string{cfg.Kernel.Image(), cfg.Initramfs}, cfg.Disks...)
		if cfg.MemoryFile != "" && cfg.MemoryFD == nil {
			// A snapshot's RAM (ShareMemory): QEMU opens it for writing
			// through the descriptor, which the file's mode must allow.
			paths = append(paths, cfg.MemoryFile)
		}
		for _, p := range paths {
			if _, ok := cfg.fdPaths[p]; ok {
				continue
			}
			f, err := os.Open(p)
			if err != nil {
				return nil, err
			}
			cfg.fdPaths[p] = "/proc/self/fd/" + strconv.Itoa(pass(f))
		}
		if cfg.MemoryFD != nil {
			cfg.fdPaths[memFDKey] = "/proc/self/fd/" + strconv.Itoa(pass(cfg.MemoryFD))
		}
	} else if cfg.MemoryFD != nil {
		return nil, errors.New("a memory descriptor needs a credential")
	}
	v := &VM{cfg: cfg, stderr: &tail{max: 4096}, console: &tail{max: ConsoleBytes}, done: make(chan struct{})}
	if cfg.Credential != nil {
		var lifeR *os.File
		v.cmd, lifeR, v.lifeline, err = jailCommand(cfg.Jailer, bin, cfg.Args(), cfg.Credential, cfg.Accel == "kvm", cfg.fileBytes(), files)
		if err != nil {
			return nil, err
		}
		defer lifeR.Close()
	} else {
		// Unjailed, as root: the tests of this package, and the KVM probe,
		// whose guest is cage's own.
		v.cmd = exec.Command(bin, cfg.Args()...)
		v.cmd.Dir = "/"
		v.cmd.ExtraFiles = files
		// QEMU goes with the process that started it.
		v.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	}
	v.cmd.Stdout, v.cmd.Stderr = v.console, v.stderr
	if err := startAt(v.cmd, cfg.Background); err != nil {
		if v.lifeline != nil {
			v.lifeline.Close()
		}
		return nil, err
	}
	go func() {
		v.err = v.cmd.Wait()
		close(v.done)
	}()
	return v, nil
}

// waitRunning connects to QMP and asks QEMU for its status, which it
// answers once the VM runs.
func (v *VM) waitRunning(ctx context.Context) error {
	q, err := v.qmp(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	return v.checkRunning(ctx, q)
}

// qmp opens a QMP session with QEMU.
func (v *VM) qmp(ctx context.Context) (*qmp, error) {
	conn, err := v.dial(ctx, filepath.Join(v.cfg.Dir, QMPSocket))
	if err != nil {
		return nil, err
	}
	q, err := newQMP(ctx, conn)
	if err != nil {
		return nil, v.qemuGone(ctx, err)
	}
	return q, nil
}

// checkRunning asks QEMU whether the VM runs.
func (v *VM) checkRunning(ctx context.Context, q *qmp) error {
	r, err := q.call(ctx, "query-status", nil)
	if err != nil {
		return v.qemuGone(ctx, err)
	}
	var status struct {
		Status string `json:"status"`
	}
	_ = json.Unmarshal(r, &status)
	if status.Status != "running" {
		return fmt.Errorf("qemu is %q, not running", status.Status)
	}
	return nil
}

// qemuGone turns a broken QMP session into what QEMU said when it exited,
// which is the cause, if it exits.
func (v *VM) qemuGone(ctx context.Context, err error) error {
	var qe *qmpError
	if ctx.Err() != nil || errors.As(err, &qe) {
		return err
	}
	select {
	case <-v.done:
		return errors.New(v.exitReason())
	case <-time.After(time.Second):
		return err
	}
}

// dial connects to one of QEMU's sockets, waiting for QEMU to make it.
func (v *VM) dial(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	for {
		c, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			return c, nil
		}
		// Not there yet, or not yet listening: retry. Anything else is an
		// answer.
		if !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, err
		}
		select {
		case <-v.done:
			return nil, errors.New(v.exitReason())
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// Dir is the VM's directory.
func (v *VM) Dir() string { return v.cfg.Dir }

// Pid is QEMU's process id.
func (v *VM) Pid() int { return v.cmd.Process.Pid }

// DialAgent connects to the agent port's socket. The connection is there
// at once; what the guest writes arrives once it has booted.
func (v *VM) DialAgent(ctx context.Context) (net.Conn, error) {
	c, err := v.dial(ctx, filepath.Join(v.cfg.Dir, AgentSocket))
	if err != nil {
		return nil, fmt.Errorf("dial agent: %w", err)
	}
	return c, nil
}

// Exited is closed once QEMU has ended and been reaped.
func (v *VM) Exited() <-chan struct{} { return v.done }

// Wait waits for QEMU to end and says how it did: nil for a clean exit (the
// guest powered off, rebooted or panicked, given -no-reboot).
func (v *VM) Wait() error {
	<-v.done
	if v.err != nil {
		return errors.New(v.exitReason())
	}
	return nil
}

// Stop kills QEMU, reaps it and removes its sockets; Console stays.
// It is safe to call more than once and after QEMU has ended.
func (v *VM) Stop() {
	v.stop.Do(func() {
		select {
		case <-v.done:
		default:
			// SIGKILL: the guest has nothing to save; its disks are the
			// host's business.
			_ = v.cmd.Process.Kill()
			<-v.done
		}
		v.cleanup()
	})
}

func (v *VM) cleanup() {
	for _, s := range []string{AgentSocket, QMPSocket} {
		_ = os.Remove(filepath.Join(v.cfg.Dir, s))
	}
	if v.lifeline != nil {
		v.lifeline.Close()
	}
}

// exitReason describes how QEMU ended, with its last line of errors; only
// after done is closed.
func (v *VM) exitReason() string {
	msg := "qemu exited"
	if v.err != nil {
		msg += " (" + v.err.Error() + ")"
	}
	if line := v.stderr.lastLine(); line != "" {
		msg += ": " + strings.TrimPrefix(line, QEMU+": ")
	}
	return msg
}
