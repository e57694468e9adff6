//go:build linux && amd64

package seccomp

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// seccompData mirrors struct seccomp_data.
type seccompData struct {
	nr   uint32
	arch uint32
	ip   uint64
	args [6]uint64
}

func (d seccompData) bytes() []byte {
	b := make([]byte, 64)
	binary.LittleEndian.PutUint32(b[0:], d.nr)
	binary.LittleEndian.PutUint32(b[4:], d.arch)
	binary.LittleEndian.PutUint64(b[8:], d.ip)
	for i, a := range d.args {
		binary.LittleEndian.PutUint64(b[16+8*i:], a)
	}
	return b
}

// x86 builds seccomp_data for an x86_64 syscall.
func x86(nr uintptr, args ...uint64) seccompData {
	d := seccompData{nr: uint32(nr), arch: unix.AUDIT_ARCH_X86_64}
	copy(d.args[:], args)
	return d
}

// interpret runs a classic BPF program on d the way the kernel's seccomp
// does, for the subset of instructions seccomp accepts. It returns the
// verdict and the number of instructions executed.
func interpret(prog []unix.SockFilter, d seccompData) (verdict uint32, steps int, err error) {
	data := d.bytes()
	var a, x uint32
	var mem [16]uint32
	for pc := 0; pc < len(prog); pc++ {
		steps++
		in := prog[pc]
		k := in.K
		switch in.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			if k%4 != 0 || k+4 > uint32(len(data)) {
				return 0, steps, fmt.Errorf("pc %d: bad load offset %d", pc, k)
			}
			a = binary.LittleEndian.Uint32(data[k:])
		case unix.BPF_LD | unix.BPF_W | unix.BPF_LEN:
			a = uint32(len(data))
		case unix.BPF_LD | unix.BPF_IMM:
			a = k
		case unix.BPF_LDX | unix.BPF_IMM:
			x = k
		case unix.BPF_LD | unix.BPF_MEM:
			a = mem[k&15]
		case unix.BPF_LDX | unix.BPF_MEM:
			x = mem[k&15]
		case unix.BPF_ST:
			mem[k&15] = a
		case unix.BPF_STX:
			mem[k&15] = x
		case unix.BPF_ALU | unix.BPF_AND | unix.BPF_K:
			a &= k
		case unix.BPF_ALU | unix.BPF_OR | unix.BPF_K:
			a |= k
		case unix.BPF_ALU | unix.BPF_RSH | unix.BPF_K:
			a >>= k
		case unix.BPF_MISC | unix.BPF_TAX:
			x = a
		case unix.BPF_MISC | unix.BPF_TXA:
			a = x
		case unix.BPF_JMP | unix.BPF_JA:
			pc += int(k)
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K:
			pc += branch(a == k, in)
		case unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K:
			pc += branch(a > k, in)
		case unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K:
			pc += branch(a >= k, in)
		case unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K:
			pc += branch(a&k != 0, in)
		case unix.BPF_RET | unix.BPF_K:
			return k, steps, nil
		case unix.BPF_RET | unix.BPF_A:
			return a, steps, nil
		default:
			return 0, steps, fmt.Errorf("pc %d: unsupported opcode %#x", pc, in.Code)
		}
	}
	return 0, steps, fmt.Errorf("fell off the end of the program")
}

func branch(cond bool, in unix.SockFilter) int {
	if cond {
		return int(in.Jt)
	}
	return int(in.Jf)
}

const (
	vAllow  = unix.SECCOMP_RET_ALLOW
	vEPERM  = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	vENOSYS = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
	vEPROTO = unix.SECCOMP_RET_ERRNO | uint32(unix.EPROTONOSUPPORT)
	vEINVAL = unix.SECCOMP_RET_ERRNO | uint32(unix.EINVAL)
)

func verdictName(v uint32) string {
	switch v {
	case vAllow:
		return "ALLOW"
	case vEPERM:
		return "EPERM"
	case vENOSYS:
		return "ENOSYS"
	case vEPROTO:
		return "EPROTONOSUPPORT"
	case vEINVAL:
		return "EINVAL"
	}
	return fmt.Sprintf("%#x", v)
}

func mustProgram(t testing.TB) []unix.SockFilter {
	t.Helper()
	prog, err := Program()
	if err != nil {
		t.Fatal(err)
	}
	return prog
}

func check(t *testing.T, prog []unix.SockFilter, what string, d seccompData, want uint32) {
	t.Helper()
	got, _, err := interpret(prog, d)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if got != want {
		t.Errorf("%s: got %s, want %s", what, verdictName(got), verdictName(want))
	}
}

func TestProgramShape(t *testing.T) {
	prog := mustProgram(t)
	if len(prog) > maxInsns {
		t.Fatalf("program has %d instructions", len(prog))
	}
	m, err := policy()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d instructions, %d allowed syscalls, %d filtered, %d runs", len(prog), len(allowed), len(filtered), len(spans(m)))

	// The arch check must come first: the first instruction loads arch.
	if prog[0].Code != unix.BPF_LD|unix.BPF_W|unix.BPF_ABS || prog[0].K != offArch {
		t.Errorf("first instruction %+v does not load arch", prog[0])
	}
	// Same input, same program.
	again := mustProgram(t)
	if fmt.Sprint(prog) != fmt.Sprint(again) {
		t.Error("Program is not deterministic")
	}
	// The hot path is short: no syscall number takes more than ~log2(runs)
	// comparisons plus the prologue.
	worst := 0
	for nr := uintptr(0); nr < 600; nr++ {
		_, steps, err := interpret(prog, x86(nr))
		if err != nil {
			t.Fatal(err)
		}
		worst = max(worst, steps)
	}
	_, getpidSteps, _ := interpret(prog, x86(unix.SYS_GETPID))
	t.Logf("getpid runs %d instructions; the worst syscall number %d", getpidSteps, worst)
	if worst > 25 {
		t.Errorf("worst-case path is %d instructions", worst)
	}
}

func TestVerdictsMatchTable(t *testing.T) {
	prog := mustProgram(t)
	m, err := policy()
	if err != nil {
		t.Fatal(err)
	}
	for nr := uint32(0); nr < 2048; nr++ {
		want := uint32(vEPERM)
		switch m[nr] {
		case actAllow:
			want = vAllow
		case actENOSYS:
			want = vENOSYS
		case actClone, actSocket, actIoctl, actPersonality, actSetsockopt, actSeccomp, actPrctl, actSetrlimit, actPrlimit:
			continue // argument-dependent; see TestArgumentFilters
		}
		check(t, prog, fmt.Sprintf("nr %d", nr), x86(uintptr(nr)), want)
	}
	for _, nr := range []uint32{0x3fffffff, 0x7fffffff, 0x80000000, 0xfffffffe, 0xffffffff} {
		check(t, prog, fmt.Sprintf("nr %#x", nr), x86(uintptr(nr)), vEPERM)
	}
}

// Every number of the x86_64 table must be classified on purpose: allowed,
// filtered or listed in denied. 337..423 are unused (the range that other
// architectures used when the tables were unified).
func TestEverySyscallClassified(t *testing.T) {
	m, err := policy()
	if err != nil {
		t.Fatal(err)
	}
	den := map[uint32]bool{}
	for _, s := range denied {
		den[uint32(s.nr)] = true
	}
	for nr := uint32(0); nr <= unix.SYS_RSEQ_SLICE_YIELD; nr++ {
		if nr > unix.SYS_UPROBE && nr < unix.SYS_PIDFD_SEND_SIGNAL {
			continue
		}
		if _, ok := m[nr]; !ok && !den[nr] {
			t.Errorf("syscall %d is neither allowed, filtered nor denied", nr)
		}
	}
}

func TestArchAndX32(t *testing.T) {
	prog := mustProgram(t)
	// The i386 ABI: every number is denied, including getpid (20 on i386)
	// and numbers that are allowed on x86_64.
	for _, nr := range []uint32{0, 1, 3, 20, 39, 120, 0x40000027} {
		check(t, prog, fmt.Sprintf("i386 nr %d", nr), seccompData{nr: nr, arch: unix.AUDIT_ARCH_I386}, vEPERM)
	}
	for _, arch := range []uint32{0, unix.AUDIT_ARCH_AARCH64, unix.AUDIT_ARCH_X86_64 ^ 1} {
		check(t, prog, fmt.Sprintf("arch %#x", arch), seccompData{nr: unix.SYS_GETPID, arch: arch}, vEPERM)
	}
	// x32: the same numbers with bit 30 set.
	for _, nr := range []uintptr{unix.SYS_GETPID, unix.SYS_READ, unix.SYS_WRITE, unix.SYS_EXIT_GROUP} {
		check(t, prog, fmt.Sprintf("x32 nr %d", nr), x86(nr|x32Bit), vEPERM)
		check(t, prog, fmt.Sprintf("x86_64 nr %d", nr), x86(nr), vAllow)
	}
}

// The calls the brief names, checked by name rather than through the table.
func TestNamedVerdicts(t *testing.T) {
	prog := mustProgram(t)
	mustAllow := []uintptr{
		unix.SYS_READ, unix.SYS_WRITE, unix.SYS_OPENAT, unix.SYS_CLOSE, unix.SYS_MMAP,
		unix.SYS_MUNMAP, unix.SYS_MADVISE, unix.SYS_FUTEX, unix.SYS_RT_SIGACTION,
		unix.SYS_RT_SIGPROCMASK, unix.SYS_RT_SIGRETURN, unix.SYS_SIGALTSTACK,
		unix.SYS_GETTID, unix.SYS_TGKILL, unix.SYS_EXIT, unix.SYS_EXIT_GROUP,
		unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_CTL, unix.SYS_EPOLL_CREATE1, unix.SYS_EVENTFD2,
		unix.SYS_PIPE2, unix.SYS_FCNTL, unix.SYS_SCHED_GETAFFINITY, unix.SYS_SCHED_YIELD,
		unix.SYS_NANOSLEEP, unix.SYS_CLOCK_GETTIME, unix.SYS_PRLIMIT64, unix.SYS_GETRLIMIT,
		unix.SYS_EXECVE, unix.SYS_WAIT4, unix.SYS_WAITID, unix.SYS_PIDFD_OPEN,
		unix.SYS_PIDFD_SEND_SIGNAL, unix.SYS_VFORK, unix.SYS_PRCTL, unix.SYS_ARCH_PRCTL,
		unix.SYS_SETITIMER, unix.SYS_TIMER_CREATE, unix.SYS_TIMER_SETTIME, unix.SYS_GETRANDOM,
		unix.SYS_LANDLOCK_CREATE_RULESET, unix.SYS_LANDLOCK_ADD_RULE,
		unix.SYS_LANDLOCK_RESTRICT_SELF, unix.SYS_MSEAL, unix.SYS_ADJTIMEX,
		unix.SYS_SETSID, unix.SYS_SETPGID, unix.SYS_SETRESUID, unix.SYS_SETGROUPS,
		unix.SYS_CAPSET,
	}
	for _, nr := range mustAllow {
		check(t, prog, fmt.Sprintf("nr %d", nr), x86(nr), vAllow)
	}
	mustDeny := []uintptr{
		unix.SYS_IO_URING_SETUP, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER,
		unix.SYS_USERFAULTFD, unix.SYS_BPF, unix.SYS_PERF_EVENT_OPEN, unix.SYS_KEYCTL,
		unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY, unix.SYS_PTRACE, unix.SYS_PROCESS_VM_READV,
		unix.SYS_PROCESS_VM_WRITEV, unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT,
		unix.SYS_MOVE_MOUNT, unix.SYS_OPEN_TREE, unix.SYS_FSOPEN, unix.SYS_FSCONFIG,
		unix.SYS_FSMOUNT, unix.SYS_FSPICK, unix.SYS_MOUNT_SETATTR, unix.SYS_UNSHARE,
		unix.SYS_SETNS, unix.SYS_KEXEC_LOAD, unix.SYS_KEXEC_FILE_LOAD, unix.SYS_INIT_MODULE,
		unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE, unix.SYS_ACCT, unix.SYS_SWAPON,
		unix.SYS_SWAPOFF, unix.SYS_REBOOT, unix.SYS_SETTIMEOFDAY, unix.SYS_CLOCK_SETTIME,
		unix.SYS_SETHOSTNAME, unix.SYS_SETDOMAINNAME, unix.SYS_QUOTACTL,
		unix.SYS_LOOKUP_DCOOKIE, unix.SYS_NFSSERVCTL, unix.SYS_IOPL, unix.SYS_IOPERM,
		unix.SYS_NAME_TO_HANDLE_AT, unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_SYSLOG,
		unix.SYS_USELIB, unix.SYS_CREATE_MODULE, unix.SYS_GET_KERNEL_SYMS,
		unix.SYS_QUERY_MODULE, unix.SYS_PIDFD_GETFD, unix.SYS_MEMFD_SECRET,
		unix.SYS_FANOTIFY_INIT, unix.SYS_OPEN_TREE_ATTR, unix.SYS_QUOTACTL_FD,
		unix.SYS_KCMP, unix.SYS_VHANGUP,
	}
	for _, nr := range mustDeny {
		check(t, prog, fmt.Sprintf("nr %d", nr), x86(nr), vEPERM)
	}
	check(t, prog, "clone3", x86(unix.SYS_CLONE3), vENOSYS)
	for _, nr := range []uintptr{unix.SYS_IO_SETUP, unix.SYS_IO_SUBMIT, unix.SYS_IO_GETEVENTS, unix.SYS_IO_PGETEVENTS, unix.SYS_IO_CANCEL, unix.SYS_IO_DESTROY} {
		check(t, prog, fmt.Sprintf("aio nr %d", nr), x86(nr), vENOSYS)
	}
}

func TestArgumentFilters(t *testing.T) {
	prog := mustProgram(t)
	const sigchld = uint64(unix.SIGCHLD)
	const hi = uint64(1) << 32

	// clone: Go's fork (vfork + pidfd) and thread flags pass; any namespace
	// flag is denied; the kernel ignores the high word, and so does the filter.
	goThread := uint64(unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND |
		unix.CLONE_SYSVSEM | unix.CLONE_THREAD)
	glibcThread := goThread | unix.CLONE_SETTLS | unix.CLONE_PARENT_SETTID | unix.CLONE_CHILD_CLEARTID
	for _, f := range []uint64{
		sigchld,
		unix.CLONE_VM | unix.CLONE_VFORK | sigchld,
		unix.CLONE_VM | unix.CLONE_VFORK | unix.CLONE_PIDFD | sigchld,
		goThread, glibcThread,
		unix.CLONE_CHILD_SETTID | unix.CLONE_CHILD_CLEARTID | sigchld, // glibc fork
		sigchld | hi,
	} {
		check(t, prog, fmt.Sprintf("clone(%#x)", f), x86(unix.SYS_CLONE, f), vAllow)
	}
	for _, ns := range []uint64{
		unix.CLONE_NEWNS, unix.CLONE_NEWUTS, unix.CLONE_NEWIPC, unix.CLONE_NEWUSER,
		unix.CLONE_NEWPID, unix.CLONE_NEWNET, unix.CLONE_NEWCGROUP, unix.CLONE_NEWTIME,
	} {
		for _, base := range []uint64{sigchld, unix.CLONE_VM | unix.CLONE_VFORK | sigchld, glibcThread} {
			check(t, prog, fmt.Sprintf("clone(%#x)", base|ns), x86(unix.SYS_CLONE, base|ns), vEPERM)
			check(t, prog, fmt.Sprintf("clone(%#x)", base|ns|hi), x86(unix.SYS_CLONE, base|ns|hi), vEPERM)
		}
	}

	// socket.
	type sock struct{ family, typ, proto uint64 }
	okSocks := []sock{
		{unix.AF_UNIX, unix.SOCK_STREAM, 0},
		{unix.AF_UNIX, unix.SOCK_DGRAM | unix.SOCK_CLOEXEC, 0},
		{unix.AF_INET, unix.SOCK_STREAM, 0},
		{unix.AF_INET, unix.SOCK_STREAM | unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC, 0},
		{unix.AF_INET, unix.SOCK_DGRAM, unix.IPPROTO_ICMP}, // ping socket
		{unix.AF_INET6, unix.SOCK_DGRAM, 0},
		{unix.AF_INET6, unix.SOCK_STREAM | unix.SOCK_CLOEXEC, 0},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE},
		{unix.AF_NETLINK, unix.SOCK_DGRAM | unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE | hi}, // the kernel reads an int
		{unix.AF_UNIX, unix.SOCK_RAW, 0},                          // SOCK_RAW matters only for IP
	}
	for _, s := range okSocks {
		check(t, prog, fmt.Sprintf("socket%v", s), x86(unix.SYS_SOCKET, s.family, s.typ, s.proto), vAllow)
	}
	badSocks := []sock{
		{unix.AF_ALG, unix.SOCK_SEQPACKET, 0},
		{unix.AF_VSOCK, unix.SOCK_STREAM, 0},
		{unix.AF_PACKET, unix.SOCK_RAW, 0},
		{unix.AF_PACKET, unix.SOCK_DGRAM | unix.SOCK_CLOEXEC, 0},
		{unix.AF_KEY, unix.SOCK_RAW, 2},
		{unix.AF_INET, unix.SOCK_RAW, 0},
		{unix.AF_INET, unix.SOCK_RAW | unix.SOCK_CLOEXEC, unix.IPPROTO_ICMP},
		{unix.AF_INET, unix.SOCK_RAW | unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC, unix.IPPROTO_RAW},
		{unix.AF_INET6, unix.SOCK_RAW, unix.IPPROTO_ICMPV6},
		{unix.AF_INET | hi, unix.SOCK_STREAM, 0}, // non-zero high word of family
		{unix.AF_UNIX | hi, unix.SOCK_STREAM, 0},
		{unix.AF_ALG | hi, unix.SOCK_SEQPACKET, 0},
	}
	for _, s := range badSocks {
		check(t, prog, fmt.Sprintf("socket%v", s), x86(unix.SYS_SOCKET, s.family, s.typ, s.proto), vEPERM)
	}
	// Netlink but ROUTE: queued messages no cgroup is charged for. They
	// fail as on a kernel without them (EPROTONOSUPPORT), which libaudit's
	// users (useradd) take as "no audit" where EPERM makes them abort.
	badNetlink := []sock{
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_USERSOCK},
		{unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_AUDIT},
		{unix.AF_NETLINK, unix.SOCK_RAW | unix.SOCK_CLOEXEC, unix.NETLINK_KOBJECT_UEVENT},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_NETFILTER},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_GENERIC},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_SOCK_DIAG},
		{unix.AF_NETLINK, unix.SOCK_RAW, 31},
		{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_AUDIT | hi},
	}
	for _, s := range badNetlink {
		check(t, prog, fmt.Sprintf("socket%v", s), x86(unix.SYS_SOCKET, s.family, s.typ, s.proto), vEPROTO)
	}

	// ioctl: the kernel reads the request as a 32-bit unsigned int, so high
	// bits must not smuggle TIOCSTI past the filter. TIOCSETD (a line
	// discipline, a module the kernel may load for it) is denied too;
	// TIOCGETD, which only reads it, passes.
	for _, req := range []uint64{unix.TIOCSTI, unix.TIOCLINUX, unix.TIOCSTI | hi, unix.TIOCSTI | 0xffffffff00000000, unix.TIOCLINUX | hi,
		unix.TIOCSETD, unix.TIOCSETD | hi} {
		check(t, prog, fmt.Sprintf("ioctl(%#x)", req), x86(unix.SYS_IOCTL, 0, req), vEPERM)
	}
	for _, req := range []uint64{unix.TCGETS, unix.TIOCGWINSZ, unix.TIOCSWINSZ, unix.TIOCSCTTY, unix.TIOCSPGRP, unix.TIOCINQ, 0x5421 /* FIONBIO */, unix.TIOCSTI + 1, unix.TIOCGETD} {
		check(t, prog, fmt.Sprintf("ioctl(%#x)", req), x86(unix.SYS_IOCTL, 0, req), vAllow)
	}

	// setsockopt(fd, level, optname): TCP MD5 and AO keys and IPv6 flow
	// labels (kernel memory no cgroup is charged for) are denied, whatever
	// the high words; everything else passes, the same option numbers at
	// other levels included.
	type opt struct{ level, name uint64 }
	for _, o := range []opt{
		{unix.IPPROTO_TCP, unix.TCP_MD5SIG}, {unix.IPPROTO_TCP, unix.TCP_MD5SIG_EXT},
		{unix.IPPROTO_TCP, 38}, {unix.IPPROTO_TCP, 40}, {unix.IPPROTO_TCP, 42},
		{unix.IPPROTO_IPV6, 32}, {unix.IPPROTO_TCP | hi, unix.TCP_MD5SIG}, {unix.IPPROTO_IPV6, 32 | hi},
	} {
		check(t, prog, fmt.Sprintf("setsockopt%v", o), x86(unix.SYS_SETSOCKOPT, 3, o.level, o.name), vEPERM)
	}
	for _, o := range []opt{
		{unix.SOL_SOCKET, unix.SO_REUSEADDR}, {unix.SOL_SOCKET, unix.SO_RCVBUF}, {unix.SOL_SOCKET, 14},
		{unix.IPPROTO_TCP, unix.TCP_NODELAY}, {unix.IPPROTO_TCP, unix.TCP_KEEPIDLE}, {unix.IPPROTO_TCP, 37}, {unix.IPPROTO_TCP, 43},
		{unix.IPPROTO_IPV6, unix.IPV6_V6ONLY}, {unix.IPPROTO_IP, 32}, {unix.IPPROTO_IP, unix.IP_TOS},
	} {
		check(t, prog, fmt.Sprintf("setsockopt%v", o), x86(unix.SYS_SETSOCKOPT, 3, o.level, o.name), vAllow)
	}

	// seccomp(op, ...) and prctl(PR_SET_SECCOMP): a filter of the
	// sandbox's own (its SECCOMP_RET_LOG, its kills, its FLAG_LOG) has the
	// kernel write the host's audit log at the rate of its system calls,
	// and strict mode's kill is logged too: both modes fail with EINVAL,
	// as on a kernel without seccomp filters, whatever the high word of
	// op or option (the kernel reads an int). The queries pass, and so
	// does every other prctl.
	for _, op := range []uint64{unix.SECCOMP_SET_MODE_STRICT, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_SET_MODE_FILTER | hi, hi} {
		for _, flags := range []uint64{0, unix.SECCOMP_FILTER_FLAG_LOG, unix.SECCOMP_FILTER_FLAG_TSYNC} {
			check(t, prog, fmt.Sprintf("seccomp(%#x, %#x)", op, flags), x86(unix.SYS_SECCOMP, op, flags, 0x1000), vEINVAL)
		}
	}
	for _, op := range []uint64{unix.SECCOMP_GET_ACTION_AVAIL, unix.SECCOMP_GET_NOTIF_SIZES, 4, 0xffffffff} {
		check(t, prog, fmt.Sprintf("seccomp(%#x)", op), x86(unix.SYS_SECCOMP, op, 0, 0x1000), vAllow)
	}
	for _, mode := range []uint64{unix.SECCOMP_MODE_STRICT, unix.SECCOMP_MODE_FILTER} {
		check(t, prog, fmt.Sprintf("prctl(PR_SET_SECCOMP, %d)", mode), x86(unix.SYS_PRCTL, unix.PR_SET_SECCOMP, mode, 0x1000), vEINVAL)
		check(t, prog, fmt.Sprintf("prctl(PR_SET_SECCOMP|1<<32, %d)", mode), x86(unix.SYS_PRCTL, unix.PR_SET_SECCOMP|hi, mode, 0x1000), vEINVAL)
	}
	for _, opt := range []uint64{unix.PR_GET_SECCOMP, unix.PR_SET_NO_NEW_PRIVS, unix.PR_SET_NAME, unix.PR_SET_PDEATHSIG, unix.PR_SET_SECCOMP + 1, unix.PR_SET_SECCOMP - 1} {
		check(t, prog, fmt.Sprintf("prctl(%d)", opt), x86(unix.SYS_PRCTL, opt, 2), vAllow)
	}

	// setrlimit and prlimit64 of RLIMIT_CORE: a sandbox that lowered the
	// agent's 1 byte to 0 would have the kernel pipe each crash's memory
	// to the host's core_pattern helper again. Reading it passes (prlimit64
	// with new NULL), and so does every other resource.
	for _, res := range []uint64{unix.RLIMIT_CORE, unix.RLIMIT_CORE | hi} {
		check(t, prog, fmt.Sprintf("setrlimit(%#x)", res), x86(unix.SYS_SETRLIMIT, res, 0x1000), vEPERM)
		for _, pid := range []uint64{0, 1, 4242} {
			for _, newp := range []uint64{0x1000, hi, 0x7fff00001000} {
				check(t, prog, fmt.Sprintf("prlimit64(%d, %#x, new %#x)", pid, res, newp), x86(unix.SYS_PRLIMIT64, pid, res, newp, 0x2000), vEPERM)
				check(t, prog, fmt.Sprintf("prlimit64(%d, %#x, new %#x, old NULL)", pid, res, newp), x86(unix.SYS_PRLIMIT64, pid, res, newp, 0), vEPERM)
			}
			check(t, prog, fmt.Sprintf("prlimit64(%d, %#x, NULL, old)", pid, res), x86(unix.SYS_PRLIMIT64, pid, res, 0, 0x2000), vAllow)
		}
	}
	for _, res := range []uint64{unix.RLIMIT_NOFILE, unix.RLIMIT_STACK, unix.RLIMIT_CPU, unix.RLIMIT_AS, unix.RLIMIT_NPROC, unix.RLIMIT_CORE + 1, unix.RLIMIT_CORE - 1} {
		check(t, prog, fmt.Sprintf("setrlimit(%d)", res), x86(unix.SYS_SETRLIMIT, res, 0x1000), vAllow)
		check(t, prog, fmt.Sprintf("prlimit64(0, %d, new)", res), x86(unix.SYS_PRLIMIT64, 0, res, 0x1000, 0), vAllow)
	}

	// personality.
	for _, p := range []uint64{0, 8, 0x20000, 0x20008, 0xffffffff} {
		check(t, prog, fmt.Sprintf("personality(%#x)", p), x86(unix.SYS_PERSONALITY, p), vAllow)
	}
	for _, p := range []uint64{0x0400000 /* READ_IMPLIES_EXEC */, 0x0040000 /* ADDR_NO_RANDOMIZE */, 0x0200000, 1, 0x0008000, 0xfffffffe} {
		check(t, prog, fmt.Sprintf("personality(%#x)", p), x86(unix.SYS_PERSONALITY, p), vEPERM)
	}
}

func TestProgramWithOtherErrno(t *testing.T) {
	prog, err := program(unix.EHWPOISON)
	if err != nil {
		t.Fatal(err)
	}
	want := unix.SECCOMP_RET_ERRNO | uint32(unix.EHWPOISON)
	check(t, prog, "mount", x86(unix.SYS_MOUNT), want)
	check(t, prog, "getpid", x86(unix.SYS_GETPID), vAllow)
	check(t, prog, "clone3", x86(unix.SYS_CLONE3), vENOSYS)
	if _, err := program(0); err == nil {
		t.Error("program(0) succeeded")
	}
}

// The assembler relaxes conditional jumps whose target is more than 255
// instructions away into a jump over a BPF_JA trampoline.
func TestAssemblerLongJumps(t *testing.T) {
	for _, gap := range []int{0, 1, 250, 254, 255, 256, 257, 1000, 4000} {
		a := newAsm()
		a.ldAbs(offNr)
		a.jeq(6, next, "notsix") // short both ways
		a.ret(6)
		a.bind("notsix")
		a.jeq(7, "far1", next)   // far true branch
		a.jeq(8, next, "far2")   // far false branch
		a.jge(8, "far1", "far2") // both far
		for i := 0; i < gap; i++ {
			a.ret(1000 + uint32(i)) // filler that must never run
		}
		a.bind("far1")
		a.ret(1)
		a.bind("far2")
		a.ret(2)
		prog, err := a.assemble()
		if err != nil {
			t.Fatalf("gap %d: %v", gap, err)
		}
		for nr, want := range map[uint32]uint32{6: 6, 7: 1, 8: 1, 3: 2, 9: 2} {
			got, _, err := interpret(prog, seccompData{nr: nr})
			if err != nil || got != want {
				t.Errorf("gap %d nr %d: got %d, %v; want %d", gap, nr, got, err, want)
			}
		}
		base := gap + 8
		if gap < 250 && len(prog) != base {
			t.Errorf("gap %d: %d instructions, want %d (no trampolines)", gap, len(prog), base)
		}
		if gap > 260 && len(prog) != base+4 {
			t.Errorf("gap %d: %d instructions, want %d (four trampolines)", gap, len(prog), base+4)
		}
	}
}

func TestAssemblerErrors(t *testing.T) {
	cases := map[string]func(a *asm){
		"undefined label": func(a *asm) { a.ldAbs(0); a.jeq(1, "nowhere", next); a.ret(0) },
		"backward jump": func(a *asm) {
			a.bind("top")
			a.ldAbs(0)
			a.jeq(1, "top", next)
			a.ret(0)
		},
		"bound twice":        func(a *asm) { a.bind("x"); a.ldAbs(0); a.bind("x"); a.ret(0) },
		"no final return":    func(a *asm) { a.ldAbs(0) },
		"label past the end": func(a *asm) { a.ldAbs(0); a.jeq(1, "end", next); a.ret(0); a.bind("end") },
		"too long": func(a *asm) {
			for i := 0; i <= maxInsns; i++ {
				a.ret(0)
			}
		},
		"empty": func(a *asm) {},
	}
	for name, build := range cases {
		a := newAsm()
		build(a)
		if _, err := a.assemble(); err == nil {
			t.Errorf("%s: assembled without error", name)
		} else if !strings.HasPrefix(err.Error(), "seccomp: bpf:") {
			t.Errorf("%s: unexpected error %v", name, err)
		}
	}
}
