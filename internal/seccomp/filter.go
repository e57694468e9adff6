//go:build linux && amd64

package seccomp

import (
	"fmt"
	"sort"

	"golang.org/x/sys/unix"
)

// Offsets into struct seccomp_data (little-endian x86_64):
//
//	struct seccomp_data {
//		int   nr;                  // 0
//		__u32 arch;                // 4
//		__u64 instruction_pointer; // 8
//		__u64 args[6];             // 16 + 8*i
//	};
//
// Classic BPF loads 32-bit words, so argument i is two loads: its low word
// at 16+8i and its high word at 20+8i.
const (
	offNr   = 0
	offArch = 4
)

func argLo(i uint32) uint32 { return 16 + 8*i }
func argHi(i uint32) uint32 { return 20 + 8*i }

// Verdicts.
const (
	retAllow  = unix.SECCOMP_RET_ALLOW
	retENOSYS = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
	retNoProt = unix.SECCOMP_RET_ERRNO | uint32(unix.EPROTONOSUPPORT)
	retEINVAL = unix.SECCOMP_RET_ERRNO | uint32(unix.EINVAL)
)

// x32Bit is __X32_SYSCALL_BIT: x86_64 syscall numbers with it set use the x32
// ABI, which shares AUDIT_ARCH_X86_64 with the 64-bit ABI.
const x32Bit = 0x40000000

// nsCloneFlags are the clone flags that create namespaces: CLONE_NEWNS,
// CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
// CLONE_NEWNET (0x7E020000, Docker's mask) and CLONE_NEWTIME (0x80).
// CLONE_NEWTIME sits in the exit-signal byte of clone(2)'s flags; no valid
// exit signal has bit 0x80, so masking it costs nothing.
const nsCloneFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS |
	unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
	unix.CLONE_NEWTIME

// Denied socket arguments.
var (
	deniedFamilies = []uint32{
		unix.AF_ALG,    // kernel crypto API: a large, bug-prone surface
		unix.AF_VSOCK,  // host/guest sockets; Docker denies it too
		unix.AF_PACKET, // raw link-layer access
		unix.AF_KEY,    // IPsec key management
	}
	// For AF_INET and AF_INET6, SOCK_RAW is denied.
	sockTypeMask uint32 = 0xf // SOCK_TYPE_MASK: strips SOCK_NONBLOCK and SOCK_CLOEXEC
	// For AF_NETLINK, only NETLINK_ROUTE (interfaces, addresses, routes:
	// getifaddrs, ip). A netlink socket's queued messages are charged to
	// no cgroup, up to its receive buffer (8 MiB), so every family is
	// memory outside the sandbox's limit; the others (NETLINK_USERSOCK:
	// 195 sockets queued 1.5 GiB from a 128 MiB sandbox, found by review
	// 2026-12-03; audit, uevents, netfilter, ...) serve nothing a sandbox
	// needs. ROUTE's own replies are a known gap (docs/SECURITY.md). The
	// others fail with EPROTONOSUPPORT, as on a kernel built without
	// them, not EPERM: libaudit's users (shadow's useradd, groupadd,
	// passwd; adduser in packages' install scripts) go on without audit
	// on that, but abort on EPERM ("Cannot open audit interface").
	allowedNetlink uint32 = unix.NETLINK_ROUTE
)

// Denied setsockopt options, by level: each keeps kernel memory that is
// charged to no cgroup (sock_kmalloc, bounded only per socket by
// net.core.optmem_max): TCP MD5 signature keys (2,904 sockets held 2.8
// million of them, 521 MiB, from a 128 MiB sandbox: found by review,
// 2026-12-03) and TCP-AO keys, and IPv6 flow labels, which also come
// from one pool of 4,096 for the whole host. Nothing a sandbox runs needs
// them (BGP speakers sign their sessions with MD5).
var deniedSockopts = map[uint32][]uint32{
	unix.IPPROTO_TCP: {
		unix.TCP_MD5SIG, unix.TCP_MD5SIG_EXT,
		38, 39, 40, 41, 42, // TCP_AO_ADD_KEY, _DEL_KEY, _INFO, _GET_KEYS, _REPAIR
	},
	unix.IPPROTO_IPV6: {32}, // IPV6_FLOWLABEL_MGR
}

// Denied ioctl requests: TIOCSTI and TIOCLINUX inject input into a
// terminal, which lets code that shares a terminal with a more privileged
// process type commands into it. TIOCSETD changes a terminal's line
// discipline: on a host kernel with dev.tty.ldisc_autoload (the default)
// any user's TIOCSETD loads the discipline's module (n_hdlc, slcan, ...,
// kernel code with a history of races, CVE-2017-2636), and the ones
// built in are reached from the sandbox's own ptys; no program a sandbox
// runs sets one (ldattach, pppd, slattach need CAP_NET_ADMIN besides).
var deniedIoctls = []uint32{unix.TIOCSTI, unix.TIOCLINUX, unix.TIOCSETD}

// A filter of the sandbox's own (seccomp(SECCOMP_SET_MODE_FILTER), or
// prctl(PR_SET_SECCOMP)) and strict mode fail with EINVAL, as on a kernel
// built without seccomp filters. The kernel writes an audit record
// (AUDIT_SECCOMP) for every system call a filter's SECCOMP_RET_LOG lets
// through, for every SECCOMP_RET_KILL and strict mode's kill, and for
// whatever a filter with SECCOMP_FILTER_FLAG_LOG refuses: whether or not
// auditing is on, with kernel.seccomp.actions_logged's default (every
// action but allow), and audit is the host's, not a namespace's. Found by
// review, 2026-12-05: one process of a sandbox had 328,000 records made
// in 3 s, each handed to the host's kauditd (0.64 s of its CPU, charged
// to no sandbox), then to auditd or journald where they listen (the
// host's audit trail and journal, rotated away), else to the kernel log,
// where they used up the host's shared printk rate limit. Programs that
// sandbox themselves this way go on without it where the kernel has no
// filters (OpenSSH, Firefox); the querying operations still work.
const (
	seccompFirstQuery = unix.SECCOMP_SET_MODE_FILTER + 1 // GET_ACTION_AVAIL; the modes are below
	prSetSeccomp      = unix.PR_SET_SECCOMP
)

// RLIMIT_CORE may not be changed (EPERM): the agent sets it to 1 byte
// for itself and every command (inside.LimitCoreDumps). Where the host's
// kernel.core_pattern is a pipe (systemd-coredump, apport: the default
// of most distributions), the kernel runs that helper on the host, as
// root, outside the sandbox's cgroups, for every process that dies of a
// signal that dumps core, and hands it the whole memory of the process,
// whatever RLIMIT_CORE is (the helper reads it to decide) but for 1,
// which the kernel reserves to stop a helper's own crash from recursing
// and so skips the pipe for; a file core needs a page at least. The
// sandbox could lower 1 to 0 (lowering needs no privilege) and open the
// pipe again: setrlimit and prlimit64 of RLIMIT_CORE with a new value
// are refused, reading it is not.
const rlimitCore = unix.RLIMIT_CORE

// allowedPersonalities are the personality(2) arguments Docker allows:
// PER_LINUX, PER_LINUX32, UNAME26, UNAME26|PER_LINUX32 and 0xffffffff (query
// the current personality). Flags such as READ_IMPLIES_EXEC or
// ADDR_NO_RANDOMIZE are denied.
var allowedPersonalities = []uint32{0x0, 0x8, 0x20000, 0x20008, 0xffffffff}

// Labels of the shared blocks.
const (
	lAllow       label = "allow"
	lDeny        label = "deny"
	lENOSYS      label = "enosys"
	lNoProtocol  label = "eprotonosupport"
	lClone       label = "clone"
	lSocket      label = "socket"
	lSocketInet  label = "socket.inet"
	lIoctl       label = "ioctl"
	lPersonality label = "personality"
	lSocketNL    label = "socket.netlink"
	lSetsockopt  label = "setsockopt"
	lSeccomp     label = "seccomp"
	lPrctl       label = "prctl"
	lEINVAL      label = "einval"
	lSetrlimit   label = "setrlimit"
	lPrlimit     label = "prlimit64"
)

func actionLabel(a action) label {
	switch a {
	case actAllow:
		return lAllow
	case actENOSYS:
		return lENOSYS
	case actClone:
		return lClone
	case actSocket:
		return lSocket
	case actIoctl:
		return lIoctl
	case actPersonality:
		return lPersonality
	case actSetsockopt:
		return lSetsockopt
	case actSeccomp:
		return lSeccomp
	case actPrctl:
		return lPrctl
	case actSetrlimit:
		return lSetrlimit
	case actPrlimit:
		return lPrlimit
	}
	return lDeny
}

// policy returns the action of every syscall number in the table. It fails
// if a number appears twice, so that a typo cannot silently allow a call.
func policy() (map[uint32]action, error) {
	m := make(map[uint32]action)
	add := func(s sc, a action) error {
		if s.nr >= x32Bit {
			return fmt.Errorf("seccomp: %s: number %d out of range", s.name, s.nr)
		}
		if prev, dup := m[uint32(s.nr)]; dup {
			return fmt.Errorf("seccomp: %s (%d) listed twice (%v and %v)", s.name, s.nr, prev, a)
		}
		m[uint32(s.nr)] = a
		return nil
	}
	for _, s := range allowed {
		if err := add(s, actAllow); err != nil {
			return nil, err
		}
	}
	for _, f := range filtered {
		if err := add(f.sc, f.act); err != nil {
			return nil, err
		}
	}
	for _, s := range denied {
		if a, ok := m[uint32(s.nr)]; ok {
			return nil, fmt.Errorf("seccomp: %s (%d) is both denied and %v", s.name, s.nr, a)
		}
	}
	return m, nil
}

// span is a run [start, next span's start) of syscall numbers with one action.
type span struct {
	start uint32
	act   action
}

// spans turns the table into consecutive runs covering [0, 2^32). The last
// run, past the highest listed number, is denied.
func spans(m map[uint32]action) []span {
	nrs := make([]uint32, 0, len(m))
	for nr := range m {
		nrs = append(nrs, nr)
	}
	sort.Slice(nrs, func(i, j int) bool { return nrs[i] < nrs[j] })

	var out []span
	push := func(start uint32, a action) {
		if len(out) > 0 && out[len(out)-1].act == a {
			return // extends the previous run
		}
		out = append(out, span{start, a})
	}
	expect := uint32(0)
	for _, nr := range nrs {
		if nr != expect {
			push(expect, actDeny) // the gap before nr
		}
		push(nr, m[nr])
		expect = nr + 1
	}
	push(expect, actDeny)
	return out
}

// Program returns the filter as BPF instructions (for tests and inspection).
//
// Layout:
//
//  1. arch != AUDIT_ARCH_X86_64 → EPERM (denies the i386 int 0x80 and
//     sysenter ABIs, whose numbers differ from x86_64's).
//  2. nr has the x32 bit → EPERM.
//  3. A binary search over the runs of syscall numbers with the same action
//     (about 8 comparisons), whose leaves jump to allow, deny or one of the
//     argument-checking blocks.
//  4. The argument-checking blocks and the shared returns.
func Program() ([]unix.SockFilter, error) { return program(unix.EPERM) }

// program builds the filter with denied calls failing with denyErrno. Only
// the tests pass anything but EPERM: a distinctive errno proves that a denial
// came from the filter and not from the kernel's own permission checks.
func program(denyErrno unix.Errno) ([]unix.SockFilter, error) {
	if denyErrno == 0 || denyErrno > unix.SECCOMP_RET_DATA {
		return nil, fmt.Errorf("seccomp: bad errno %d", denyErrno)
	}
	m, err := policy()
	if err != nil {
		return nil, err
	}
	a := newAsm()

	a.ldAbs(offArch)
	a.jeq(unix.AUDIT_ARCH_X86_64, next, lDeny)
	a.ldAbs(offNr)
	a.jset(x32Bit, lDeny, next)
	emitSearch(a, spans(m))
	emitClone(a)
	emitSocket(a)
	emitIoctl(a)
	emitPersonality(a)
	emitSetsockopt(a)
	emitSeccomp(a)
	emitPrctl(a)
	emitRlimits(a)

	a.bind(lEINVAL)
	a.ret(retEINVAL)
	a.bind(lENOSYS)
	a.ret(retENOSYS)
	a.bind(lNoProtocol)
	a.ret(retNoProt)
	a.bind(lAllow)
	a.ret(retAllow)
	a.bind(lDeny)
	a.ret(unix.SECCOMP_RET_ERRNO | uint32(denyErrno))
	return a.assemble()
}

// emitSearch emits a binary search over spans, which must start at 0 and be
// sorted. The syscall number must be in A. A subtree of one span is not
// emitted: its parent jumps straight to the span's action label. Every
// internal node is one JGE; its false branch falls through to the left
// subtree, emitted right after it.
func emitSearch(a *asm, ss []span) {
	if len(ss) == 1 {
		a.ja(actionLabel(ss[0].act))
		return
	}
	n := 0
	var node func(lo, hi int) label
	var emit func(lo, hi int, l label)
	// node returns the label to jump to for spans [lo, hi).
	node = func(lo, hi int) label {
		if hi-lo == 1 {
			return actionLabel(ss[lo].act)
		}
		n++
		return label(fmt.Sprintf("search.%d", n))
	}
	emit = func(lo, hi int, l label) {
		mid := (lo + hi) / 2
		left, right := node(lo, mid), node(mid, hi)
		a.bind(l)
		if hi-lo == 2 {
			a.jge(ss[mid].start, right, left)
			return
		}
		if mid-lo > 1 {
			// The left subtree follows immediately; fall through into it.
			a.jge(ss[mid].start, right, next)
			emit(lo, mid, left)
		} else {
			a.jge(ss[mid].start, right, left)
		}
		if hi-mid > 1 {
			emit(mid, hi, right)
		}
	}
	root := node(0, len(ss))
	emit(0, len(ss), root)
}

// emitClone: clone(flags, ...). Only the low word of flags is checked: the
// kernel itself uses lower_32_bits(clone_flags) and ignores the high word, and
// all namespace flags live in the low word.
func emitClone(a *asm) {
	a.bind(lClone)
	a.ldAbs(argLo(0))
	a.jset(nsCloneFlags, lDeny, lAllow)
}

// emitSocket: socket(family, type, protocol). Both are C ints, so the kernel
// ignores their high words; a non-zero high word of family is nevertheless
// denied (no legitimate caller passes one). The type is masked with
// SOCK_TYPE_MASK, as the kernel does, before comparing with SOCK_RAW.
func emitSocket(a *asm) {
	a.bind(lSocket)
	a.ldAbs(argHi(0))
	a.jeq(0, next, lDeny)
	a.ldAbs(argLo(0))
	for _, f := range deniedFamilies {
		a.jeq(f, lDeny, next)
	}
	a.jeq(unix.AF_NETLINK, lSocketNL, next)
	a.jeq(unix.AF_INET, lSocketInet, next)
	a.jeq(unix.AF_INET6, lSocketInet, lAllow)
	a.bind(lSocketInet)
	a.ldAbs(argLo(1))
	a.and(sockTypeMask)
	a.jeq(unix.SOCK_RAW, lDeny, lAllow)
	// The protocol is a C int too: its low word is what the kernel reads.
	a.bind(lSocketNL)
	a.ldAbs(argLo(2))
	a.jeq(allowedNetlink, lAllow, lNoProtocol)
}

// emitSetsockopt: setsockopt(fd, level, optname, ...). level and optname
// are C ints: only their low words are compared, as the kernel reads them.
func emitSetsockopt(a *asm) {
	a.bind(lSetsockopt)
	levels := make([]uint32, 0, len(deniedSockopts))
	for l := range deniedSockopts {
		levels = append(levels, l)
	}
	sort.Slice(levels, func(i, j int) bool { return levels[i] < levels[j] })
	a.ldAbs(argLo(1))
	for i, l := range levels {
		if i == len(levels)-1 {
			a.jeq(l, label(fmt.Sprintf("setsockopt.%d", l)), lAllow)
		} else {
			a.jeq(l, label(fmt.Sprintf("setsockopt.%d", l)), next)
		}
	}
	for _, l := range levels {
		a.bind(label(fmt.Sprintf("setsockopt.%d", l)))
		a.ldAbs(argLo(2))
		opts := deniedSockopts[l]
		for i, o := range opts {
			if i == len(opts)-1 {
				a.jeq(o, lDeny, lAllow)
			} else {
				a.jeq(o, lDeny, next)
			}
		}
	}
}

// emitSeccomp: seccomp(op, flags, args). op is an unsigned int: its low
// word is what the kernel reads. The modes (strict 0, filter 1) fail; the
// queries above them pass.
func emitSeccomp(a *asm) {
	a.bind(lSeccomp)
	a.ldAbs(argLo(0))
	a.jge(seccompFirstQuery, lAllow, lEINVAL)
}

// emitPrctl: prctl(option, ...). option is an int: its low word is what
// the kernel reads.
func emitPrctl(a *asm) {
	a.bind(lPrctl)
	a.ldAbs(argLo(0))
	a.jeq(prSetSeccomp, lEINVAL, lAllow)
}

// emitRlimits: setrlimit(resource, rlim) and prlimit64(pid, resource,
// new, old). resource is an unsigned int: its low word is what the kernel
// reads. new is a pointer: prlimit64 only reads (old) when all of it is
// zero (NULL).
func emitRlimits(a *asm) {
	a.bind(lSetrlimit)
	a.ldAbs(argLo(0))
	a.jeq(rlimitCore, lDeny, lAllow)
	a.bind(lPrlimit)
	a.ldAbs(argLo(1))
	a.jeq(rlimitCore, next, lAllow)
	a.ldAbs(argLo(2))
	a.jeq(0, next, lDeny)
	a.ldAbs(argHi(2))
	a.jeq(0, lAllow, lDeny)
}

// emitIoctl: ioctl(fd, request, ...). The kernel takes request as an
// unsigned int, so only the low word matters; comparing all 64 bits would be
// a bug (setting a high bit would slip TIOCSTI past a 64-bit equality test).
func emitIoctl(a *asm) {
	a.bind(lIoctl)
	a.ldAbs(argLo(1))
	for i, r := range deniedIoctls {
		if i == len(deniedIoctls)-1 {
			a.jeq(r, lDeny, lAllow)
		} else {
			a.jeq(r, lDeny, next)
		}
	}
}

// emitPersonality: personality(persona). The kernel takes an unsigned int,
// so only the low word is compared.
func emitPersonality(a *asm) {
	a.bind(lPersonality)
	a.ldAbs(argLo(0))
	for i, p := range allowedPersonalities {
		if i == len(allowedPersonalities)-1 {
			a.jeq(p, lAllow, lDeny)
		} else {
			a.jeq(p, lAllow, next)
		}
	}
}
