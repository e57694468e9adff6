package conformance

import (
	"os"
	"strings"
	"testing"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// Rows that probe privilege and the kernel's attack surface: mounts,
// namespaces, ptrace, /proc, modules, keyrings, io_uring, bpf, socket
// families, setuid binaries, other syscall ABIs, terminal injection and
// signals to the agent. Unless said otherwise they run as root and as user
// in the shared sandbox.

var bothUsers = []string{"root", "user"}

// Syscall numbers of the x86_64 table and flags, spelled out so that the
// probes do not depend on the python build knowing them.
const pySyscalls = `
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID, SIGCHLD = 0x20000, 0x10000000, 0x40000000, 0x20000000, 17
`

// uncharged is what the uncharged_kernel_memory row wants on every wall,
// and more.
func uncharged(more ...string) []string {
	return append([]string{"netlink_usersock=OSError EPROTONOSUPPORT", "netlink_audit=OSError EPROTONOSUPPORT", "md5=PermissionError EPERM",
		"md5_ext=PermissionError EPERM", "nodelay=SET"}, more...)
}

func kernelRows() []hostileRow {
	return []hostileRow{
		{
			name:   "mount_commands",
			expect: "mount -t tmpfs and umount fail (EPERM / must be superuser); /tmp stays the sandbox's disk",
			users:  bothUsers,
			script: `mount -t tmpfs none /tmp && echo MOUNTED; umount /tmp && echo UNMOUNTED; mount --bind /usr /mnt && echo BOUND
grep -c ' /tmp ' /proc/self/mountinfo; exit 1`,
			check: noneOf(fails(), "MOUNTED", "UNMOUNTED", "BOUND"),
		},
		{
			name:   "unshare_commands",
			expect: "unshare -U / -r / -m / -n fail with Operation not permitted",
			users:  bothUsers,
			script: `for f in -U -r -m -n -p; do unshare $f true && echo "UNSHARED $f"; done; exit 1`,
			check:  noneOf(fails("Operation not permitted"), "UNSHARED"),
		},
		{
			name:   "mount_unshare_setns_syscalls",
			expect: "mount(2), unshare(CLONE_NEWUSER|NEWNS|NEWNET), setns on /proc/self/ns/{net,mnt,user}, open_tree, fsopen, pivot_root, chroot escape: EPERM",
			users:  bothUsers,
			argv: py(pySyscalls + `
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
ctypes.set_errno(0)
r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
print("mount=%d %s" % (r, errno.errorcode.get(ctypes.get_errno())))
show("unshare_user", 272, CLONE_NEWUSER)
show("unshare_mnt", 272, CLONE_NEWNS)
show("unshare_net", 272, CLONE_NEWNET)
for ns in ("net", "mnt", "user", "pid", "uts", "ipc", "cgroup"):
    try:
        fd = os.open("/proc/self/ns/" + ns, os.O_RDONLY)
    except FileNotFoundError:
        # gVisor has no cgroup namespace file; the filter is what is tested
        # with a namespace that does exist, and any fd will do for the call.
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    show("setns_" + ns, 308, fd, 0)
show("fsopen", 430, 0, 0)
show("open_tree", 428, -100, 0, 0)
show("pivot_root", 155, 0, 0)
show("umount2", 166, 0, 0)
`),
			check: exitsOK("mount=-1 EPERM", "unshare_user=-1 EPERM", "unshare_mnt=-1 EPERM", "unshare_net=-1 EPERM",
				"setns_net=-1 EPERM", "setns_mnt=-1 EPERM", "setns_user=-1 EPERM", "setns_pid=-1 EPERM",
				"setns_uts=-1 EPERM", "setns_ipc=-1 EPERM", "setns_cgroup=-1 EPERM",
				"fsopen=-1 EPERM", "open_tree=-1 EPERM", "pivot_root=-1 EPERM", "umount2=-1 EPERM"),
		},
		{
			name:   "ptrace_agent",
			expect: "ptrace(PTRACE_ATTACH, 1), process_vm_readv and pidfd_getfd on the agent: EPERM",
			users:  bothUsers,
			argv: py(`
show("ptrace_attach", 101, 16, 1, 0, 0)
show("ptrace_seize", 101, 0x4206, 1, 0, 0)
show("process_vm_readv", 310, 1, 0, 0, 0, 0, 0)
pidfd = sc(434, 1, 0)
print("pidfd_open", pidfd)
if not pidfd.startswith("-"):
    show("pidfd_getfd", 438, int(pidfd.split()[0]), 3, 0)
else:
    print("pidfd_getfd=-1 EPERM")
`),
			check: exitsOK("ptrace_attach=-1 EPERM", "ptrace_seize=-1 EPERM", "process_vm_readv=-1 EPERM", "pidfd_getfd=-1 EPERM"),
		},
		{
			name:   "agent_proc_files",
			expect: "/proc/1/{environ,mem,maps,fd,fdinfo,root,cwd,exe,map_files} of the agent: permission denied, also for root",
			users:  bothUsers,
			script: `
cat /proc/1/environ >/dev/null 2>&1 && echo "READ environ"
head -c 16 /proc/1/mem >/dev/null 2>&1 && echo "READ mem"
cat /proc/1/maps >/dev/null 2>&1 && echo "READ maps"
ls /proc/1/fd >/dev/null 2>&1 && echo "LISTED fd: $(ls /proc/1/fd | tr '\n' ' ')"
for f in /proc/1/fd/*; do readlink "$f" >/dev/null 2>&1 && echo "READLINK $f"; done
cat /proc/1/fdinfo/3 >/dev/null 2>&1 && echo "READ fdinfo"
ls /proc/1/root/ >/dev/null 2>&1 && echo "LISTED root"
readlink /proc/1/cwd >/dev/null 2>&1 && echo "READLINK cwd"
readlink /proc/1/exe >/dev/null 2>&1 && echo "READLINK exe"
ls /proc/1/map_files/ >/dev/null 2>&1 && echo "LISTED map_files"
exit 0`,
			check: noneOf(exitsOK(), "READ", "LISTED", "READLINK"),
			on: map[string]wallOutcome{"gvisor": {
				expect: "gVisor's own /proc lets a process list PID 1's descriptor numbers and read their fdinfo (its kernel's rule, and the descriptors are the sentry's own, revealing nothing of the host); environ, mem, maps, root, cwd, exe, map_files and the fd links stay closed",
				check:  noneOf(exitsOK(), "READ environ", "READ mem", "READ maps", "READLINK", "LISTED root", "LISTED map_files"),
			}},
		},
		{
			name:   "proc_sysrq_kcore_sys",
			expect: "writing /proc/sysrq-trigger fails; /proc/kcore reads nothing; /proc/sys is read-only (core_pattern, hostname, drop_caches writes fail, host's core_pattern unchanged)",
			users:  bothUsers,
			custom: procWrites,
		},
		{
			name:   "kernel_modules",
			expect: "init_module, finit_module, delete_module, kexec_load: EPERM",
			users:  bothUsers,
			argv: py(`
show("init_module", 175, 0, 0, 0)
fd = os.open("/dev/null", os.O_RDONLY)
show("finit_module", 313, fd, 0, 0)
show("delete_module", 176, 0, 0)
show("kexec_load", 246, 0, 0, 0, 0)
`),
			check: exitsOK("init_module=-1 EPERM", "finit_module=-1 EPERM", "delete_module=-1 EPERM", "kexec_load=-1 EPERM"),
		},
		{
			name:   "keyrings",
			expect: "add_key, request_key, keyctl: EPERM (keyrings are not namespaced)",
			users:  bothUsers,
			argv: py(`
show("add_key", 248, 0, 0, 0, 0, -2)
show("request_key", 249, 0, 0, 0, 0)
show("keyctl", 250, 0, -3, 0, 0, 0)
`),
			check: exitsOK("add_key=-1 EPERM", "request_key=-1 EPERM", "keyctl=-1 EPERM"),
		},
		{
			name:   "io_uring_userfaultfd_perf",
			expect: "io_uring_setup, io_uring_enter, userfaultfd, perf_event_open: EPERM",
			users:  bothUsers,
			argv: py(`
params = ctypes.create_string_buffer(120)
show("io_uring_setup", 425, 4, ctypes.addressof(params))
show("io_uring_enter", 426, 0, 0, 0, 0, 0, 0)
show("userfaultfd", 323, 0)
attr = ctypes.create_string_buffer(128)
show("perf_event_open", 298, ctypes.addressof(attr), 0, -1, -1, 0)
`),
			check: exitsOK("io_uring_setup=-1 EPERM", "io_uring_enter=-1 EPERM", "userfaultfd=-1 EPERM", "perf_event_open=-1 EPERM"),
		},
		{
			name:   "bpf",
			expect: "bpf(BPF_PROG_LOAD / BPF_MAP_CREATE): EPERM",
			users:  bothUsers,
			argv: py(`
attr = ctypes.create_string_buffer(128)
show("bpf_map_create", 321, 0, ctypes.addressof(attr), 128)
show("bpf_prog_load", 321, 5, ctypes.addressof(attr), 128)
`),
			check: exitsOK("bpf_map_create=-1 EPERM", "bpf_prog_load=-1 EPERM"),
		},
		{
			name:   "socket_families",
			expect: "AF_ALG, AF_VSOCK, AF_PACKET, AF_KEY sockets and raw IPv4/IPv6 sockets (flags included): PermissionError EPERM",
			users:  bothUsers,
			argv: py(`
trysock("alg", 38, socket.SOCK_SEQPACKET, 0)
trysock("vsock", 40, socket.SOCK_STREAM, 0)
trysock("packet", 17, socket.SOCK_RAW, 0)
trysock("packet_dgram", 17, socket.SOCK_DGRAM, 0)
trysock("key", 15, socket.SOCK_RAW, 2)
trysock("raw_icmp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
trysock("raw_icmp_flags", socket.AF_INET, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK, socket.IPPROTO_ICMP)
trysock("raw6", socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
print("raw_syscall=" + sc(41, 2, 3 | (1 << 32), 1))
trysock("tcp", socket.AF_INET, socket.SOCK_STREAM, 0)
`),
			check: exitsOK("alg=PermissionError EPERM", "vsock=PermissionError EPERM", "packet=PermissionError EPERM",
				"packet_dgram=PermissionError EPERM", "key=PermissionError EPERM", "raw_icmp=PermissionError EPERM",
				"raw_icmp_flags=PermissionError EPERM", "raw6=PermissionError EPERM", "raw_syscall=-1 EPERM", "tcp=OPENED"),
		},
		{
			name: "uncharged_kernel_memory",
			expect: "what keeps kernel memory no cgroup is charged for is refused: netlink sockets but NETLINK_ROUTE (EPROTONOSUPPORT, as on a kernel without them: " +
				"audit's users such as useradd go on without it), TCP MD5 signature keys and IPv6 flow labels (EPERM) " +
				"(ROUTE and TCP_NODELAY still work); on the host kernel's walls (process, runc) each socket's option memory is 20 KiB (net.core.optmem_max)",
			users: bothUsers,
			argv: py(`
trysock("netlink_route", 16, socket.SOCK_RAW, 0)
trysock("netlink_usersock", 16, socket.SOCK_RAW, 2)
trysock("netlink_uevent", 16, socket.SOCK_DGRAM, 15)
trysock("netlink_audit", 16, socket.SOCK_RAW, 9)
def opt(name, s, level, optname, value):
    try:
        s.setsockopt(level, optname, value)
        print("%s=SET" % name, flush=True)
    except OSError as ex:
        print("%s=%s %s" % (name, type(ex).__name__, errno.errorcode.get(ex.errno)), flush=True)
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
opt("md5", t, 6, 14, bytes(216))
opt("md5_ext", t, 6, 32, bytes(216))
opt("nodelay", t, 6, 1, 1)
try:
    u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    opt("flowlabel", u, 41, 32, bytes(32))
except OSError as ex:
    print("flowlabel=no IPv6: " + type(ex).__name__, flush=True)
try:
    print("optmem=" + open("/proc/sys/net/core/optmem_max").read().strip())
except OSError as ex:
    print("optmem=" + type(ex).__name__)
`),
			check: exitsOK(uncharged("netlink_route=OPENED", "netlink_uevent=OSError EPROTONOSUPPORT", "flowlabel=PermissionError EPERM")...),
			on: map[string]wallOutcome{
				"process": {expect: "as above, and optmem_max 20480", check: exitsOK(uncharged("flowlabel=PermissionError EPERM", "optmem=20480")...)},
				"runc":    {expect: "as above, and optmem_max 20480", check: exitsOK(uncharged("flowlabel=PermissionError EPERM", "optmem=20480")...)},
				"microvm": {expect: "as above; the guest kernel has no IPv6 (no flow labels to ask for)",
					check: exitsOK(uncharged("netlink_route=OPENED", "flowlabel=")...)},
			},
		},
		{
			name: "own_seccomp_filter",
			expect: "a seccomp filter of the sandbox's own (seccomp(SECCOMP_SET_MODE_FILTER), also with SECCOMP_FILTER_FLAG_LOG, and prctl(PR_SET_SECCOMP)) fails with EINVAL, " +
				"as on a kernel without seccomp filters: its SECCOMP_RET_LOG had the host's kernel make an audit record of every call it let through " +
				"(the host's kauditd, audit log, journal or kernel log); getppid still works and seccomp's queries (GET_ACTION_AVAIL of SECCOMP_RET_ERRNO) still answer",
			users: bothUsers,
			argv: py(`
import struct
# ld nr; nr == getppid ? SECCOMP_RET_LOG : SECCOMP_RET_ALLOW
insns = struct.pack("HBBI", 0x20, 0, 0, 0) + struct.pack("HBBI", 0x15, 0, 1, 110) + \
    struct.pack("HBBI", 0x06, 0, 0, 0x7ffc0000) + struct.pack("HBBI", 0x06, 0, 0, 0x7fff0000)
ibuf = ctypes.create_string_buffer(insns)
fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", 4, ctypes.addressof(ibuf)))
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (the sandbox's commands have it already)
show("seccomp_log", 317, 1, 0, ctypes.addressof(fprog))
show("seccomp_flag_log", 317, 1, 2, ctypes.addressof(fprog))
show("prctl_seccomp", 157, 22, 2, ctypes.addressof(fprog))
for i in range(3):
    sc(110)
print("getppid=" + ("OK" if not sc(110).startswith("-") else sc(110)))
act = ctypes.c_uint32(0x00050000)  # SECCOMP_RET_ERRNO
show("action_avail", 317, 2, 0, ctypes.addressof(act))
`),
			check: exitsOK("seccomp_log=-1 EINVAL", "seccomp_flag_log=-1 EINVAL", "prctl_seccomp=-1 EINVAL", "getppid=OK", "action_avail=0 OK"),
			on: map[string]wallOutcome{"gvisor": {
				expect: "as above, but gVisor's kernel has no GET_ACTION_AVAIL (EINVAL of its own; its filters log nowhere on the host)",
				check:  exitsOK("seccomp_log=-1 EINVAL", "seccomp_flag_log=-1 EINVAL", "prctl_seccomp=-1 EINVAL", "getppid=OK", "action_avail=-1 EINVAL"),
			}},
		},
		{
			name: "core_dumps",
			expect: "RLIMIT_CORE is 1 byte, soft and hard, and cannot be changed (setrlimit and prlimit64 of it: EPERM, even to what it is; reading it works): " +
				"a process killed by SIGSEGV dumps no core (where the host's core_pattern is a pipe, its helper would run on the host, " +
				"as root, outside the sandbox's cgroups, and read the process's memory, for any limit but 1: 0 does not stop a pipe)",
			users: bothUsers,
			argv: py(`
import resource, signal
print("core_limit=%d %d" % resource.getrlimit(resource.RLIMIT_CORE), flush=True)
# Raw calls: python's resource module turns EPERM into ValueError.
soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
lim = (ctypes.c_uint64 * 2)(hard % 2**64, hard % 2**64)
show("setrlimit_soft_to_hard", 160, 4, ctypes.addressof(lim))
d = "/tmp/cores-%d" % os.getpid()
os.mkdir(d)
os.chdir(d)
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGSEGV)
    os._exit(0)
st = os.waitpid(pid, 0)[1]
print("signaled=%s dumped=%s" % (os.WIFSIGNALED(st), os.WCOREDUMP(st)), flush=True)
print("cores=%d" % len(os.listdir(d)), flush=True)
for f in os.listdir(d):
    os.unlink(f)
lim[0] = lim[1] = 0
show("setrlimit_zero", 160, 4, ctypes.addressof(lim))
show("prlimit_zero", 302, 0, 4, ctypes.addressof(lim), 0)
old = (ctypes.c_uint64 * 2)(7, 7)
show("prlimit_read", 302, 0, 4, 0, ctypes.addressof(old))
print("read=%d %d" % (old[0], old[1]), flush=True)
`),
			check: exitsOK("core_limit=1 1", "setrlimit_soft_to_hard=-1 EPERM", "signaled=True dumped=False", "cores=0",
				"setrlimit_zero=-1 EPERM", "prlimit_zero=-1 EPERM", "prlimit_read=0 OK", "read=1 1"),
		},
		{
			name: "time_wait",
			expect: "10,000 loopback connections the sandbox closes first all work; on the host kernel's walls (process, runc) at most 4,096 of them wait in TIME_WAIT " +
				"(net.ipv4.tcp_max_tw_buckets of the sandbox's network namespace; past it a closed connection skips TIME_WAIT): each is some 330 bytes of the host's " +
				"kernel memory, charged to no cgroup, for 60 s, and a namespace's default (half the host's TCP hash, 131,072 here) let one sandbox hold 43 MiB",
			users: bothUsers,
			argv: py(`
ls = []
for i in range(4):
    l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(4096); ls.append(l)
n = 0
for i in range(10000):
    l = ls[i % 4]
    c = socket.create_connection(l.getsockname())
    a, _ = l.accept()
    c.close()  # the client closes first: its end waits
    a.close()
    n += 1
tw = 0
for f in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        tw += sum(1 for line in open(f) if line.split()[3] == "06")
    except (OSError, IndexError):
        pass
print("conns=%d" % n, flush=True)
print("time_wait_bounded=%s" % (tw <= 4096), flush=True)
try:
    print("tw_buckets=" + open("/proc/sys/net/ipv4/tcp_max_tw_buckets").read().strip())
except OSError as ex:
    print("tw_buckets=" + type(ex).__name__)
`),
			check: exitsOK("conns=10000"),
			on: map[string]wallOutcome{
				"process": {expect: "as above, at most 4,096 in TIME_WAIT", check: exitsOK("conns=10000", "time_wait_bounded=True", "tw_buckets=4096")},
				"runc":    {expect: "as above, at most 4,096 in TIME_WAIT", check: exitsOK("conns=10000", "time_wait_bounded=True", "tw_buckets=4096")},
			},
		},
		{
			name:   "setuid_binaries",
			expect: "a setuid copy of id made by root in /tmp runs as uid 1000 for user; the host's setuid binaries (su, mount, newgrp...) never give euid 0; NoNewPrivs is 1",
			custom: setuidProbe,
		},
		{
			name:   "int80_and_x32",
			expect: "getpid through int 0x80 (i386 ABI) returns -EPERM; getpid with the x32 bit returns -1 EPERM",
			users:  bothUsers,
			argv: py(`
import mmap
# In a child: a kernel without the i386 ABI answers int 0x80 with SIGSEGV,
# which is as good as EPERM.
pid = os.fork()
if pid == 0:
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20 (getpid); int 0x80; ret
    f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    print("int80=%d" % f(), flush=True)
    os._exit(0)
st = os.waitpid(pid, 0)[1]
if os.WIFSIGNALED(st):
    print("int80=signal %d" % os.WTERMSIG(st))
show("x32_getpid", 39 | 0x40000000)
show("getpid", 39)
`),
			check: func(t *testing.T, r result) {
				noneOf(exitsOK("x32_getpid=-1 EPERM", "\ngetpid="), "\ngetpid=-1")(t, r)
				if !strings.Contains(r.stdout, "int80=-1\n") && !strings.Contains(r.stdout, "int80=signal 11\n") {
					t.Errorf("int 0x80 getpid: want -1 (-EPERM) or SIGSEGV (no i386 ABI)")
				}
			},
		},
		{
			name:   "clone_namespaces",
			expect: "clone with CLONE_NEWUSER / NEWNS / NEWPID / NEWNET: EPERM; clone3: ENOSYS; a plain fork works",
			users:  bothUsers,
			argv: py(pySyscalls + `
for name, flags in (("newuser", CLONE_NEWUSER), ("newns", CLONE_NEWNS), ("newpid", CLONE_NEWPID), ("newnet", CLONE_NEWNET)):
    r = sc(56, flags | SIGCHLD, 0, 0, 0, 0)
    if r.split()[0] == "0":
        os._exit(0)  # the child, should it exist
    print("clone_%s=%s" % (name, r))
args = ctypes.create_string_buffer(88)
show("clone3", 435, ctypes.addressof(args), 88)
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork_status=%d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
`),
			check: exitsOK("clone_newuser=-1 EPERM", "clone_newns=-1 EPERM", "clone_newpid=-1 EPERM", "clone_newnet=-1 EPERM",
				"clone3=-1 ENOSYS", "fork_status=7"),
		},
		{
			name:   "tiocsti_on_own_pty",
			expect: "TIOCSTI, TIOCLINUX and TIOCSETD (a line discipline: N_NULL, built in) on the command's own PTY (also with high bits set in the request): EPERM; TIOCGETD reads N_TTY",
			users:  bothUsers,
			argv: py(`
import fcntl, termios
print("isatty=%s" % os.isatty(0))
try:
    fcntl.ioctl(0, termios.TIOCSTI, b"x"); print("tiocsti=INJECTED")
except OSError as e:
    print("tiocsti=%s" % errno.errorcode.get(e.errno))
c = ctypes.c_char(b"x")
print("tiocsti_high=" + sc(16, 0, 0x5412 | (1 << 32), ctypes.addressof(c)))
print("tioclinux=" + sc(16, 0, 0x541C, ctypes.addressof(c)))
ld = ctypes.c_int(27)  # N_NULL
print("tiocsetd=" + sc(16, 0, 0x5423, ctypes.addressof(ld)))
print("tiocsetd_high=" + sc(16, 0, 0x5423 | (1 << 32), ctypes.addressof(ld)))
cur = ctypes.c_int(-1)
print("tiocgetd=%s ld=%d" % (sc(16, 0, 0x5424, ctypes.addressof(cur)), cur.value))
`),
			mods: func(*hostileEnv) []func(*agentclient.RunOptions) {
				return []func(*agentclient.RunOptions){func(o *agentclient.RunOptions) { o.PTY = &pb.PTY_Size{Cols: 80, Rows: 24} }}
			},
			check: noneOf(exitsOK("isatty=True", "tiocsti=EPERM", "tiocsti_high=-1 EPERM", "tioclinux=-1 EPERM",
				"tiocsetd=-1 EPERM", "tiocsetd_high=-1 EPERM", "tiocgetd=0 OK ld=0"), "INJECTED"),
			on: map[string]wallOutcome{
				// gVisor's terminals have no TIOCGETD: what matters is
				// that the filter does not refuse it.
				"gvisor": {expect: "as above, but TIOCGETD is not implemented by gVisor's PTY (not EPERM: the filter lets it through)",
					check: noneOf(exitsOK("isatty=True", "tiocsti=EPERM", "tiocsti_high=-1 EPERM", "tioclinux=-1 EPERM",
						"tiocsetd=-1 EPERM", "tiocsetd_high=-1 EPERM", "tiocgetd=-1 "), "INJECTED", "tiocgetd=-1 EPERM")},
			},
		},
		{
			name:   "signals_to_the_agent",
			expect: "signals sent to PID 1 (the agent) do not kill it: user gets EPERM; root's TERM/HUP/INT/QUIT/ABRT/SEGV/BUS/KILL/STOP, every other number from 1 to 64 and kill -KILL -1 leave it serving",
			users:  bothUsers,
			opts:   &sandbox.Options{}, // a fresh sandbox: if the agent dies, the rows after this one must not die with it
			script: `for s in TERM HUP INT QUIT ABRT SEGV BUS FPE SYS TRAP USR1 USR2 PIPE ALRM XCPU XFSZ VTALRM PROF KILL STOP; do kill -s $s 1 2>/dev/null; done
n=1; while [ $n -le 64 ]; do kill -$n 1 2>/dev/null; n=$((n+1)); done
kill -KILL -1 2>/dev/null; sleep 0.3; echo still-running`,
			check: exitsOK("still-running"),
		},
	}
}

func procWrites(t *testing.T, e *hostileEnv, b *box, user string) {
	hostCore, _ := os.ReadFile("/proc/sys/kernel/core_pattern")
	r := b.sh(`
echo b > /proc/sysrq-trigger 2>/dev/null && echo "WROTE sysrq-trigger"
echo "kcore=$(head -c 64 /proc/kcore 2>/dev/null | wc -c)"
echo "devcore=$(head -c 64 /dev/core 2>/dev/null | wc -c)"
echo '|/tmp/x' > /proc/sys/kernel/core_pattern 2>/dev/null && echo "WROTE core_pattern"
echo evil > /proc/sys/kernel/hostname 2>/dev/null && echo "WROTE hostname"
echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "WROTE drop_caches"
echo 1 > /proc/sys/kernel/modules_disabled 2>/dev/null && echo "WROTE modules_disabled"
echo 1 > /proc/sys/fs/protected_symlinks 2>/dev/null && echo "WROTE protected_symlinks"
touch /proc/sys/kernel/newfile 2>/dev/null && echo "WROTE newfile"
echo "kallsyms=$(head -c 64 /proc/kallsyms 2>/dev/null | wc -c)"
echo "timer_list=$(head -c 64 /proc/timer_list 2>/dev/null | wc -c)"
hostname`, asUser(user))
	if r.err != nil || r.code() != 0 {
		t.Fatalf("probe: %v %+v %q", r.err, r.end, r.stderr)
	}
	for _, bad := range []string{"WROTE", "evil"} {
		if strings.Contains(r.stdout, bad) {
			t.Errorf("stdout shows %q:\n%s", bad, r.stdout)
		}
	}
	for _, want := range []string{"kcore=0\n", "devcore=0\n", "kallsyms=0\n", "timer_list=0\n"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("want %q (masked /proc files read nothing):\n%s", want, r.stdout)
		}
	}
	if now, _ := os.ReadFile("/proc/sys/kernel/core_pattern"); string(now) != string(hostCore) {
		t.Errorf("the host's core_pattern changed: %q -> %q", hostCore, now)
	}
	if h, _ := os.Hostname(); h == "evil" {
		t.Errorf("the host's hostname changed")
	}
}

func setuidProbe(t *testing.T, e *hostileEnv, b *box, _ string) {
	b.mustSh(`cp /usr/bin/id /tmp/suid-id && chmod 4755 /tmp/suid-id`, asUser("root"))
	mode := b.mustSh(`stat -c %a:%U /tmp/suid-id`, asUser("root"))
	if strings.TrimSpace(mode) != "4755:root" {
		t.Logf("the setuid copy is %q (root in the sandbox could not set the bit)", mode)
	}
	if out := b.mustSh(`/tmp/suid-id -u; /tmp/suid-id -ru`); out != "1000\n1000\n" {
		t.Errorf("setuid copy of id as user: %q, want 1000 twice (no_new_privs, nosuid)", out)
	}
	if out := b.mustSh(`grep NoNewPrivs /proc/self/status | tr -d ' \t'`); out != "NoNewPrivs:1\n" {
		t.Errorf("NoNewPrivs: %q", out)
	}
	r := b.sh(`find /usr/bin /usr/sbin /usr/libexec /usr/lib -maxdepth 3 -xdev -perm -4000 -type f 2>/dev/null | head -20
# su and newgrp sleep a second when they fail: run them side by side.
(su root -c 'id -u > /tmp/su-out; id' </dev/null && echo "SU WORKED") &
(newgrp root </dev/null && echo "NEWGRP WORKED") &
mount -t tmpfs none /mnt </dev/null && echo "MOUNT WORKED"
umount /tmp </dev/null && echo "UMOUNT WORKED"
chsh -s /bin/sh user </dev/null && echo "CHSH WORKED"
passwd -d root </dev/null && echo "PASSWD WORKED"
wait
test -e /tmp/su-out && echo "SU WROTE $(cat /tmp/su-out)"
id -u; exit 0`)
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, bad := range []string{"WORKED", "SU WROTE", "uid=0"} {
		if strings.Contains(r.stdout, bad) {
			t.Errorf("a setuid binary gave privileges (%q):\n%s", bad, r.stdout)
		}
	}
	if !strings.HasSuffix(r.stdout, "1000\n") {
		t.Errorf("the user changed: %q", r.stdout)
	}
	t.Logf("setuid binaries seen: %s", strings.ReplaceAll(strings.TrimSpace(r.stdout), "\n", " "))
}
