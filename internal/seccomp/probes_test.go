//go:build linux && amd64

package seccomp

// The probes a filtered child runs; see seccomp_test.go.
//
// Each probe is built so that, were the filter to let it through, the kernel
// would fail it harmlessly (a missing path, a bad descriptor, an invalid
// flag) or, at worst, change only the throwaway child. The "marker" run
// installs the same filter with denials returning EHWPOISON instead of EPERM,
// which no probe could get from the kernel: it proves that each denial comes
// from the filter, even where the kernel alone would say EPERM (as it does to
// an unprivileged user for mount or init_module).

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// int80getpid is in int80_amd64_test.s.
func int80getpid() int32

type want int

const (
	wantOK        want = iota // succeeds
	wantDenied                // fails with the filter's errno
	wantENOSYS                // fails with ENOSYS
	wantEINVAL                // fails with EINVAL (from the filter: see the probe)
	wantNotDenied             // may fail, but not with the filter's errno
)

type outcome struct {
	Ret   int64  `json:"ret"`
	Errno int    `json:"errno"`
	Err   string `json:"err,omitempty"` // a compound probe's failure
}

type probe struct {
	name string
	want want
	fn   func() outcome
}

func sys(nr uintptr, args ...uintptr) outcome {
	var a [6]uintptr
	copy(a[:], args)
	r, _, e := unix.Syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5])
	return outcome{Ret: int64(r), Errno: int(e)}
}

// sysFD is sys for calls returning a descriptor, which it closes.
func sysFD(nr uintptr, args ...uintptr) outcome {
	o := sys(nr, args...)
	if o.Errno == 0 {
		unix.Close(int(o.Ret))
	}
	return o
}

// sameRlimit sets resource to the value it has, through setrlimit or
// prlimit64 (nr), which the kernel always allows.
func sameRlimit(nr uintptr, resource int) outcome {
	var rl unix.Rlimit
	if err := unix.Getrlimit(resource, &rl); err != nil {
		return fail("getrlimit: %v", err)
	}
	if nr == unix.SYS_SETRLIMIT {
		return sys(nr, uintptr(resource), uintptr(unsafe.Pointer(&rl)))
	}
	return sys(nr, 0, uintptr(resource), uintptr(unsafe.Pointer(&rl)), 0)
}

func fail(format string, args ...any) outcome {
	return outcome{Err: fmt.Sprintf(format, args...)}
}

func fromErr(err error) outcome {
	if err == nil {
		return outcome{}
	}
	if e, ok := err.(unix.Errno); ok {
		return outcome{Errno: int(e)}
	}
	return outcome{Err: err.Error()}
}

func ptr(s string) uintptr {
	p, err := unix.BytePtrFromString(s)
	if err != nil {
		panic(err)
	}
	return uintptr(unsafe.Pointer(p))
}

// rawClone calls clone(2) directly, like fork. The child exits at once,
// running no Go code that could need the runtime, whose other threads were
// not copied.
//
//go:nosplit
func rawClone(flags uintptr) (uintptr, unix.Errno) {
	pid, _, e := unix.RawSyscall6(unix.SYS_CLONE, flags, 0, 0, 0, 0, 0)
	if e == 0 && pid == 0 {
		unix.RawSyscall(unix.SYS_EXIT_GROUP, 0, 0, 0)
	}
	return pid, e
}

func cloneProbe(flags uintptr) outcome {
	pid, e := rawClone(flags)
	if e != 0 {
		return outcome{Errno: int(e)}
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(int(pid), &ws, 0, nil); err != nil {
		return fail("wait4: %v", err)
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
		return fail("clone child: status %v", ws)
	}
	return outcome{Ret: int64(pid)}
}

// probes lists the probes; int80 adds the one that executes int $0x80.
func probes(int80 bool) []probe {
	const noSuchPath = "/nonexistent-cage-seccomp-probe"
	const noSuchPid = 0x3ffffff0 // above PID_MAX_LIMIT
	ps := []probe{
		// Allowed.
		{"getpid", wantOK, func() outcome { return sys(unix.SYS_GETPID) }},
		{"read file", wantOK, readFileProbe},
		{"write stdout", wantOK, func() outcome {
			_, err := unix.Write(1, []byte("cage-seccomp: write to stdout\n"))
			return fromErr(err)
		}},
		{"exec /bin/true", wantOK, func() outcome { return fromErr(exec.Command("/bin/true").Run()) }},
		{"exec uses pidfd", wantOK, pidfdProbe},
		{"exec like the agent", wantOK, agentExecProbe},
		{"new threads", wantOK, threadsProbe},
		{"all threads filtered", wantOK, allThreadsFilteredProbe},
		{"go runtime", wantOK, runtimeProbe},
		{"clone(SIGCHLD)", wantOK, func() outcome { return cloneProbe(uintptr(unix.SIGCHLD)) }},
		{"socket(AF_INET, SOCK_STREAM)", wantOK, func() outcome {
			return sysFD(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		}},
		{"socket(AF_UNIX, SOCK_STREAM)", wantOK, func() outcome {
			return sysFD(unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		}},
		{"socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE)", wantOK, func() outcome {
			return sysFD(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
		}},
		{"ioctl(FIONREAD)", wantOK, func() outcome {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				return fromErr(err)
			}
			defer unix.Close(p[0])
			defer unix.Close(p[1])
			var n int32
			return sys(unix.SYS_IOCTL, uintptr(p[0]), unix.TIOCINQ, uintptr(unsafe.Pointer(&n)))
		}},
		{"personality(0xffffffff)", wantOK, func() outcome { return sys(unix.SYS_PERSONALITY, 0xffffffff) }},
		{"prctl(PR_GET_NO_NEW_PRIVS)", wantOK, func() outcome {
			o := sys(unix.SYS_PRCTL, unix.PR_GET_NO_NEW_PRIVS)
			if o.Errno == 0 && o.Ret != 1 {
				return fail("no_new_privs is %d", o.Ret)
			}
			return o
		}},
		{"landlock_create_ruleset(VERSION)", wantNotDenied, func() outcome {
			return sys(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
		}},

		// Denied.
		{"mount", wantDenied, func() outcome { return sys(unix.SYS_MOUNT, ptr("none"), ptr(noSuchPath), ptr("tmpfs"), 0, 0) }},
		{"umount2", wantDenied, func() outcome { return sys(unix.SYS_UMOUNT2, ptr(noSuchPath), 0) }},
		{"pivot_root", wantDenied, func() outcome { return sys(unix.SYS_PIVOT_ROOT, ptr(noSuchPath), ptr(noSuchPath)) }},
		{"setns", wantDenied, func() outcome { return sys(unix.SYS_SETNS, ^uintptr(0), 0) }},
		{"clone(CLONE_NEWUSER|SIGCHLD)", wantDenied, func() outcome {
			return cloneProbe(unix.CLONE_NEWUSER | uintptr(unix.SIGCHLD))
		}},
		{"clone(CLONE_NEWNET|CLONE_NEWNS|SIGCHLD)", wantDenied, func() outcome {
			return cloneProbe(unix.CLONE_NEWNET | unix.CLONE_NEWNS | uintptr(unix.SIGCHLD))
		}},
		{"bpf", wantDenied, func() outcome { return sys(unix.SYS_BPF, 0xffff, 0, 0) }},
		{"perf_event_open", wantDenied, func() outcome { return sys(unix.SYS_PERF_EVENT_OPEN, 0, 0, ^uintptr(0), ^uintptr(0), 0) }},
		{"keyctl", wantDenied, func() outcome { return sys(unix.SYS_KEYCTL, 9999, 0, 0) }},
		{"add_key", wantDenied, func() outcome { return sys(unix.SYS_ADD_KEY, 0, 0, 0, 0, 0) }},
		{"request_key", wantDenied, func() outcome { return sys(unix.SYS_REQUEST_KEY, 0, 0, 0, 0) }},
		{"ptrace(PTRACE_ATTACH)", wantDenied, func() outcome { return sys(unix.SYS_PTRACE, unix.PTRACE_ATTACH, noSuchPid, 0, 0) }},
		{"process_vm_readv", wantDenied, func() outcome {
			return sys(unix.SYS_PROCESS_VM_READV, uintptr(os.Getpid()), 0, 0, 0, 0, 0)
		}},
		{"io_uring_setup", wantDenied, func() outcome { return sysFD(unix.SYS_IO_URING_SETUP, 0, 0) }},
		{"userfaultfd", wantDenied, func() outcome { return sysFD(unix.SYS_USERFAULTFD, 0xffffffff) }},
		{"kexec_load", wantDenied, func() outcome { return sys(unix.SYS_KEXEC_LOAD, 0, 1000, 0, 0xdead0000) }},
		{"init_module", wantDenied, func() outcome { return sys(unix.SYS_INIT_MODULE, 0, 0, ptr("")) }},
		{"finit_module", wantDenied, func() outcome { return sys(unix.SYS_FINIT_MODULE, ^uintptr(0), ptr(""), 0) }},
		{"delete_module", wantDenied, func() outcome { return sys(unix.SYS_DELETE_MODULE, ptr("cage_no_such_module"), 0) }},
		{"socket(AF_ALG)", wantDenied, func() outcome { return sysFD(unix.SYS_SOCKET, unix.AF_ALG, unix.SOCK_SEQPACKET, 0) }},
		{"socket(AF_VSOCK)", wantDenied, func() outcome { return sysFD(unix.SYS_SOCKET, unix.AF_VSOCK, unix.SOCK_STREAM, 0) }},
		{"socket(AF_PACKET)", wantDenied, func() outcome { return sysFD(unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_RAW, 0) }},
		{"socket(AF_INET, SOCK_RAW|SOCK_CLOEXEC)", wantDenied, func() outcome {
			return sysFD(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		}},
		{"socket(AF_INET6, SOCK_RAW)", wantDenied, func() outcome {
			return sysFD(unix.SYS_SOCKET, unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6)
		}},
		// On /dev/null, which is no terminal: ENOTTY if let through.
		{"ioctl(TIOCSTI)", wantDenied, func() outcome { return devNullIoctl(unix.TIOCSTI) }},
		{"ioctl(TIOCSTI | 1<<32)", wantDenied, func() outcome { return devNullIoctl(unix.TIOCSTI | 1<<32) }},
		{"ioctl(TIOCLINUX)", wantDenied, func() outcome { return devNullIoctl(unix.TIOCLINUX) }},
		{"ioctl(TIOCSETD)", wantDenied, func() outcome { return devNullIoctl(unix.TIOCSETD) }},
		{"personality(READ_IMPLIES_EXEC)", wantDenied, func() outcome { return sys(unix.SYS_PERSONALITY, 0x0400000) }},
		{"personality(ADDR_NO_RANDOMIZE)", wantDenied, func() outcome { return sys(unix.SYS_PERSONALITY, 0x0040000) }},
		{"x32 getpid", wantDenied, func() outcome { return sys(unix.SYS_GETPID | x32Bit) }},
		{"syscall 1000", wantDenied, func() outcome { return sys(1000) }},
		{"clone3", wantENOSYS, func() outcome { return sys(unix.SYS_CLONE3, 0, 0) }},
		// Legacy AIO: a context of 1 event would be a real allocation
		// against the host's one fs.aio-max-nr if let through.
		{"io_setup", wantENOSYS, func() outcome {
			var ctx uint64
			return sys(unix.SYS_IO_SETUP, 1, uintptr(unsafe.Pointer(&ctx)))
		}},
		{"io_submit", wantENOSYS, func() outcome { return sys(unix.SYS_IO_SUBMIT, 0, 0, 0) }},
		// A filter of the child's own: with no program (NULL) the kernel
		// says EFAULT, so EINVAL is the filter's. Strict mode has no such
		// harmless probe (TestArgumentFilters covers it).
		{"seccomp(SET_MODE_FILTER)", wantEINVAL, func() outcome { return sys(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, 0) }},
		{"seccomp(SET_MODE_FILTER, FLAG_LOG)", wantEINVAL, func() outcome {
			return sys(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_LOG, 0)
		}},
		{"prctl(PR_SET_SECCOMP, FILTER)", wantEINVAL, func() outcome { return sys(unix.SYS_PRCTL, unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, 0) }},
		// Queries still work.
		{"seccomp(GET_ACTION_AVAIL, LOG)", wantOK, func() outcome {
			act := uint32(unix.SECCOMP_RET_LOG)
			return sys(unix.SYS_SECCOMP, unix.SECCOMP_GET_ACTION_AVAIL, 0, uintptr(unsafe.Pointer(&act)))
		}},
		{"prctl(PR_GET_SECCOMP)", wantOK, func() outcome { return sys(unix.SYS_PRCTL, unix.PR_GET_SECCOMP) }},
		// RLIMIT_CORE: set to what it is (the kernel would allow that), and
		// read; other limits set as they are.
		{"setrlimit(RLIMIT_CORE, same)", wantDenied, func() outcome { return sameRlimit(unix.SYS_SETRLIMIT, unix.RLIMIT_CORE) }},
		{"prlimit64(0, RLIMIT_CORE, same)", wantDenied, func() outcome { return sameRlimit(unix.SYS_PRLIMIT64, unix.RLIMIT_CORE) }},
		{"prlimit64(0, RLIMIT_CORE, NULL, old)", wantOK, func() outcome {
			var rl unix.Rlimit
			return sys(unix.SYS_PRLIMIT64, 0, unix.RLIMIT_CORE, 0, uintptr(unsafe.Pointer(&rl)))
		}},
		{"setrlimit(RLIMIT_NOFILE, same)", wantOK, func() outcome { return sameRlimit(unix.SYS_SETRLIMIT, unix.RLIMIT_NOFILE) }},
		{"prlimit64(0, RLIMIT_STACK, same)", wantOK, func() outcome { return sameRlimit(unix.SYS_PRLIMIT64, unix.RLIMIT_STACK) }},
	}
	if int80 {
		ps = append(ps, probe{"int 0x80 getpid", wantDenied, func() outcome {
			r := int80getpid()
			if r < 0 {
				return outcome{Ret: int64(r), Errno: int(-r)}
			}
			return outcome{Ret: int64(r)}
		}})
	}
	// Last, since they would change the child's namespaces if allowed.
	ps = append(ps,
		probe{"unshare(CLONE_NEWUSER)", wantDenied, func() outcome { return sys(unix.SYS_UNSHARE, unix.CLONE_NEWUSER) }},
		probe{"unshare(CLONE_NEWNS)", wantDenied, func() outcome { return sys(unix.SYS_UNSHARE, unix.CLONE_NEWNS) }},
	)
	return ps
}

func devNullIoctl(req uintptr) outcome {
	fd, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fromErr(err)
	}
	defer unix.Close(fd)
	c := byte('x')
	return sys(unix.SYS_IOCTL, uintptr(fd), req, uintptr(unsafe.Pointer(&c)))
}

func readFileProbe() outcome {
	b, err := os.ReadFile(os.Getenv(fileEnv))
	if err != nil {
		return fromErr(err)
	}
	if string(b) != fileContent {
		return fail("read %q", b)
	}
	return outcome{}
}

// pidfdProbe checks that os/exec still gets a pidfd for its child: Go checks
// once whether pidfd_open, waitid(P_PIDFD) and clone(CLONE_PIDFD) work and
// silently falls back to plain pids if any of them is refused.
func pidfdProbe() outcome {
	cmd := exec.Command("/bin/cat")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return fromErr(err)
	}
	if err := cmd.Start(); err != nil {
		return fromErr(err)
	}
	found := false
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); l == "anon_inode:[pidfd]" {
			found = true
		}
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		return fromErr(err)
	}
	if !found {
		return fail("no pidfd among the process's descriptors")
	}
	return outcome{}
}

// agentExecProbe starts a process the way the agent starts user commands: in
// a new session, with a pty as controlling terminal (open /dev/ptmx, the pty
// ioctls, TIOCSCTTY) and with credentials (setgroups, setgid, setuid).
func agentExecProbe() outcome {
	attr := &syscall.SysProcAttr{Setsid: true}
	if os.Geteuid() == 0 {
		attr.Credential = &syscall.Credential{Uid: 65534, Gid: 65534, Groups: []uint32{}}
	} else {
		// Without CAP_SETGID the kernel refuses setgroups; keep our ids.
		attr.Credential = &syscall.Credential{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid()), NoSetGroups: true}
	}
	cmd := exec.Command("/bin/true")
	cmd.SysProcAttr = attr
	ptmx, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err == nil {
		defer ptmx.Close()
		if err := unix.IoctlSetPointerInt(int(ptmx.Fd()), unix.TIOCSPTLCK, 0); err != nil {
			return fail("unlockpt: %v", err)
		}
		n, err := unix.IoctlGetUint32(int(ptmx.Fd()), unix.TIOCGPTN)
		if err != nil {
			return fail("ptsname: %v", err)
		}
		tty, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			return fail("open pts: %v", err)
		}
		defer tty.Close()
		if _, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS); err != nil {
			return fail("tcgetattr: %v", err)
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		attr.Setctty, attr.Ctty = true, 0
	}
	if err := cmd.Run(); err != nil {
		return fail("run: %v", err)
	}
	return outcome{}
}

// allThreadsFilteredProbe checks that TSYNC reached every thread.
func allThreadsFilteredProbe() outcome {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return fromErr(err)
	}
	for _, task := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + task.Name() + "/status")
		if err != nil {
			continue // the thread exited
		}
		s := string(b)
		if !strings.Contains(s, "\nSeccomp:\t2\n") || !strings.Contains(s, "\nNoNewPrivs:\t1\n") {
			return fail("thread %s is not filtered", task.Name())
		}
	}
	return outcome{Ret: int64(len(tasks))}
}

func threadCount() int {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return -1
}

// threadsProbe makes the runtime create new threads (clone with thread
// flags): goroutines locked to their threads and blocked in read(2) each pin
// a thread, so the runtime needs new ones to go on.
func threadsProbe() outcome {
	const n = 16
	var p [2]int
	if err := unix.Pipe(p[:]); err != nil { // blocking, outside the netpoller
		return fromErr(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	before := threadCount()
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Never unlocked: the thread exits with the goroutine.
			runtime.LockOSThread()
			var b [1]byte
			unix.Read(p[0], b[:])
		}()
	}
	// n blocked threads plus this goroutine's: at least n+1 in all, some
	// of them new unless the runtime already had that many.
	enough := func(c int) bool { return c >= n+1 && c > before }
	deadline := time.Now().Add(10 * time.Second)
	got := threadCount()
	for !enough(got) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
		got = threadCount()
	}
	unix.Write(p[1], make([]byte, n))
	wg.Wait()
	if !enough(got) {
		return fail("threads: %d before, %d after starting %d blocked goroutines", before, got, n)
	}
	return outcome{Ret: int64(got - before)}
}

// runtimeProbe exercises what the agent needs from the Go runtime: garbage
// collection, timers, signal delivery and loopback networking.
func runtimeProbe() outcome {
	runtime.GC()
	time.Sleep(time.Millisecond)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, unix.SIGUSR1)
	defer signal.Stop(sigs)
	if err := unix.Kill(os.Getpid(), unix.SIGUSR1); err != nil {
		return fail("kill: %v", err)
	}
	select {
	case <-sigs:
	case <-time.After(10 * time.Second):
		return fail("SIGUSR1 not delivered")
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail("listen: %v", err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()
	conn, err := net.DialTimeout("tcp", ln.Addr().String(), 10*time.Second)
	if err != nil {
		return fail("dial: %v", err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write([]byte("ping")); err != nil {
		return fail("write: %v", err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "ping" {
		return fail("echo: %q, %v", buf, err)
	}
	return outcome{}
}
