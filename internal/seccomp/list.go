//go:build linux && amd64

package seccomp

import "golang.org/x/sys/unix"

// action is what the filter does with one syscall number.
type action int

const (
	// actDeny returns EPERM. It is the default for every number not in the
	// policy table, so it only appears in the table for documentation.
	actDeny action = iota
	// actAllow lets the call through unconditionally.
	actAllow
	// actENOSYS returns ENOSYS (used for clone3; see filtered).
	actENOSYS
	// actClone allows clone unless its flags ask for a new namespace.
	actClone
	// actSocket allows socket except for the families and types listed in
	// filter.go.
	actSocket
	// actIoctl allows ioctl except for the terminal-injection requests.
	actIoctl
	// actPersonality allows only the personality values Docker allows.
	actPersonality
	// actSetsockopt allows setsockopt except for the options listed in
	// filter.go (deniedSockopts).
	actSetsockopt
	// actSeccomp allows seccomp(2) but its two modes (see filter.go).
	actSeccomp
	// actPrctl allows prctl(2) but PR_SET_SECCOMP (see filter.go).
	actPrctl
	// actSetrlimit allows setrlimit(2) but of RLIMIT_CORE (see filter.go).
	actSetrlimit
	// actPrlimit allows prlimit64(2) but a new RLIMIT_CORE (see filter.go).
	actPrlimit
)

func (a action) String() string {
	switch a {
	case actDeny:
		return "deny"
	case actAllow:
		return "allow"
	case actENOSYS:
		return "enosys"
	case actClone:
		return "clone"
	case actSocket:
		return "socket"
	case actIoctl:
		return "ioctl"
	case actPersonality:
		return "personality"
	case actSetsockopt:
		return "setsockopt"
	case actSeccomp:
		return "seccomp"
	case actPrctl:
		return "prctl"
	case actSetrlimit:
		return "setrlimit"
	case actPrlimit:
		return "prlimit64"
	}
	return "action?"
}

// sc names one syscall of the x86_64 table.
type sc struct {
	nr   uintptr
	name string
}

// allowed are the syscalls allowed unconditionally. It is Docker's default
// seccomp profile for an x86_64 container with Docker's default capability
// set (which includes CAP_SYS_CHROOT, hence chroot), minus the calls cage
// denies outright (see denied), plus a few newer calls that are unprivileged
// variants of calls already allowed.
var allowed = []sc{
	// File I/O and descriptors.
	{unix.SYS_READ, "read"},
	{unix.SYS_WRITE, "write"},
	{unix.SYS_OPEN, "open"},
	{unix.SYS_CLOSE, "close"},
	{unix.SYS_CLOSE_RANGE, "close_range"},
	{unix.SYS_CREAT, "creat"},
	{unix.SYS_OPENAT, "openat"},
	{unix.SYS_OPENAT2, "openat2"},
	{unix.SYS_LSEEK, "lseek"},
	{unix.SYS_PREAD64, "pread64"},
	{unix.SYS_PWRITE64, "pwrite64"},
	{unix.SYS_READV, "readv"},
	{unix.SYS_WRITEV, "writev"},
	{unix.SYS_PREADV, "preadv"},
	{unix.SYS_PWRITEV, "pwritev"},
	{unix.SYS_PREADV2, "preadv2"},
	{unix.SYS_PWRITEV2, "pwritev2"},
	{unix.SYS_DUP, "dup"},
	{unix.SYS_DUP2, "dup2"},
	{unix.SYS_DUP3, "dup3"},
	{unix.SYS_PIPE, "pipe"},
	{unix.SYS_PIPE2, "pipe2"},
	{unix.SYS_FCNTL, "fcntl"},
	{unix.SYS_FLOCK, "flock"},
	{unix.SYS_FSYNC, "fsync"},
	{unix.SYS_FDATASYNC, "fdatasync"},
	{unix.SYS_SYNC, "sync"},
	{unix.SYS_SYNCFS, "syncfs"},
	{unix.SYS_SYNC_FILE_RANGE, "sync_file_range"},
	{unix.SYS_TRUNCATE, "truncate"},
	{unix.SYS_FTRUNCATE, "ftruncate"},
	{unix.SYS_FALLOCATE, "fallocate"},
	{unix.SYS_FADVISE64, "fadvise64"},
	{unix.SYS_READAHEAD, "readahead"},
	{unix.SYS_SENDFILE, "sendfile"},
	{unix.SYS_SPLICE, "splice"},
	{unix.SYS_TEE, "tee"},
	{unix.SYS_VMSPLICE, "vmsplice"},
	{unix.SYS_COPY_FILE_RANGE, "copy_file_range"},
	{unix.SYS_CACHESTAT, "cachestat"}, // newer than Docker's list; like mincore on an fd

	// Polling and event descriptors.
	{unix.SYS_POLL, "poll"},
	{unix.SYS_PPOLL, "ppoll"},
	{unix.SYS_SELECT, "select"},
	{unix.SYS_PSELECT6, "pselect6"},
	{unix.SYS_EPOLL_CREATE, "epoll_create"},
	{unix.SYS_EPOLL_CREATE1, "epoll_create1"},
	{unix.SYS_EPOLL_CTL, "epoll_ctl"},
	{unix.SYS_EPOLL_CTL_OLD, "epoll_ctl_old"}, // not implemented by Linux (ENOSYS); Docker lists it
	{unix.SYS_EPOLL_WAIT, "epoll_wait"},
	{unix.SYS_EPOLL_WAIT_OLD, "epoll_wait_old"}, // likewise
	{unix.SYS_EPOLL_PWAIT, "epoll_pwait"},
	{unix.SYS_EPOLL_PWAIT2, "epoll_pwait2"},
	{unix.SYS_EVENTFD, "eventfd"},
	{unix.SYS_EVENTFD2, "eventfd2"},
	{unix.SYS_SIGNALFD, "signalfd"},
	{unix.SYS_SIGNALFD4, "signalfd4"},
	{unix.SYS_TIMERFD_CREATE, "timerfd_create"},
	{unix.SYS_TIMERFD_SETTIME, "timerfd_settime"},
	{unix.SYS_TIMERFD_GETTIME, "timerfd_gettime"},
	{unix.SYS_INOTIFY_INIT, "inotify_init"},
	{unix.SYS_INOTIFY_INIT1, "inotify_init1"},
	{unix.SYS_INOTIFY_ADD_WATCH, "inotify_add_watch"},
	{unix.SYS_INOTIFY_RM_WATCH, "inotify_rm_watch"},
	{unix.SYS_FANOTIFY_MARK, "fanotify_mark"}, // useless without fanotify_init, which is denied

	// File metadata and the namespace of names.
	{unix.SYS_STAT, "stat"},
	{unix.SYS_FSTAT, "fstat"},
	{unix.SYS_LSTAT, "lstat"},
	{unix.SYS_NEWFSTATAT, "newfstatat"},
	{unix.SYS_STATX, "statx"},
	{unix.SYS_STATFS, "statfs"},
	{unix.SYS_FSTATFS, "fstatfs"},
	{unix.SYS_ACCESS, "access"},
	{unix.SYS_FACCESSAT, "faccessat"},
	{unix.SYS_FACCESSAT2, "faccessat2"},
	{unix.SYS_GETDENTS, "getdents"},
	{unix.SYS_GETDENTS64, "getdents64"},
	{unix.SYS_GETCWD, "getcwd"},
	{unix.SYS_CHDIR, "chdir"},
	{unix.SYS_FCHDIR, "fchdir"},
	{unix.SYS_CHROOT, "chroot"}, // Docker allows it with its default CAP_SYS_CHROOT
	{unix.SYS_RENAME, "rename"},
	{unix.SYS_RENAMEAT, "renameat"},
	{unix.SYS_RENAMEAT2, "renameat2"},
	{unix.SYS_MKDIR, "mkdir"},
	{unix.SYS_MKDIRAT, "mkdirat"},
	{unix.SYS_RMDIR, "rmdir"},
	{unix.SYS_LINK, "link"},
	{unix.SYS_LINKAT, "linkat"},
	{unix.SYS_UNLINK, "unlink"},
	{unix.SYS_UNLINKAT, "unlinkat"},
	{unix.SYS_SYMLINK, "symlink"},
	{unix.SYS_SYMLINKAT, "symlinkat"},
	{unix.SYS_READLINK, "readlink"},
	{unix.SYS_READLINKAT, "readlinkat"},
	{unix.SYS_MKNOD, "mknod"},
	{unix.SYS_MKNODAT, "mknodat"},
	{unix.SYS_CHMOD, "chmod"},
	{unix.SYS_FCHMOD, "fchmod"},
	{unix.SYS_FCHMODAT, "fchmodat"},
	{unix.SYS_FCHMODAT2, "fchmodat2"}, // newer than Docker's list; fchmodat with flags
	{unix.SYS_CHOWN, "chown"},
	{unix.SYS_FCHOWN, "fchown"},
	{unix.SYS_LCHOWN, "lchown"},
	{unix.SYS_FCHOWNAT, "fchownat"},
	{unix.SYS_UMASK, "umask"},
	{unix.SYS_UTIME, "utime"},
	{unix.SYS_UTIMES, "utimes"},
	{unix.SYS_UTIMENSAT, "utimensat"},
	{unix.SYS_FUTIMESAT, "futimesat"},
	{unix.SYS_SETXATTR, "setxattr"},
	{unix.SYS_LSETXATTR, "lsetxattr"},
	{unix.SYS_FSETXATTR, "fsetxattr"},
	{unix.SYS_GETXATTR, "getxattr"},
	{unix.SYS_LGETXATTR, "lgetxattr"},
	{unix.SYS_FGETXATTR, "fgetxattr"},
	{unix.SYS_LISTXATTR, "listxattr"},
	{unix.SYS_LLISTXATTR, "llistxattr"},
	{unix.SYS_FLISTXATTR, "flistxattr"},
	{unix.SYS_REMOVEXATTR, "removexattr"},
	{unix.SYS_LREMOVEXATTR, "lremovexattr"},
	{unix.SYS_FREMOVEXATTR, "fremovexattr"},
	{unix.SYS_SETXATTRAT, "setxattrat"},       // newer than Docker's list; *xattr with a dirfd
	{unix.SYS_GETXATTRAT, "getxattrat"},       // likewise
	{unix.SYS_LISTXATTRAT, "listxattrat"},     // likewise
	{unix.SYS_REMOVEXATTRAT, "removexattrat"}, // likewise
	{unix.SYS_FILE_GETATTR, "file_getattr"},   // newer; the FS_IOC_FSGETXATTR ioctl as a syscall
	{unix.SYS_FILE_SETATTR, "file_setattr"},   // newer; the FS_IOC_FSSETXATTR ioctl as a syscall

	// Memory.
	{unix.SYS_BRK, "brk"},
	{unix.SYS_MMAP, "mmap"},
	{unix.SYS_MUNMAP, "munmap"},
	{unix.SYS_MPROTECT, "mprotect"},
	{unix.SYS_MREMAP, "mremap"},
	{unix.SYS_MSYNC, "msync"},
	{unix.SYS_MINCORE, "mincore"},
	{unix.SYS_MADVISE, "madvise"},
	{unix.SYS_MLOCK, "mlock"},
	{unix.SYS_MLOCK2, "mlock2"},
	{unix.SYS_MUNLOCK, "munlock"},
	{unix.SYS_MLOCKALL, "mlockall"},
	{unix.SYS_MUNLOCKALL, "munlockall"},
	{unix.SYS_REMAP_FILE_PAGES, "remap_file_pages"},
	{unix.SYS_MEMBARRIER, "membarrier"},
	{unix.SYS_MEMFD_CREATE, "memfd_create"},
	{unix.SYS_PKEY_MPROTECT, "pkey_mprotect"},
	{unix.SYS_PKEY_ALLOC, "pkey_alloc"},
	{unix.SYS_PKEY_FREE, "pkey_free"},
	{unix.SYS_MAP_SHADOW_STACK, "map_shadow_stack"}, // newer; CET shadow stacks (glibc)
	{unix.SYS_MSEAL, "mseal"},                       // newer; only restricts the caller

	// Processes, threads and signals.
	{unix.SYS_FORK, "fork"},
	{unix.SYS_VFORK, "vfork"},
	{unix.SYS_EXECVE, "execve"},
	{unix.SYS_EXECVEAT, "execveat"},
	{unix.SYS_EXIT, "exit"},
	{unix.SYS_EXIT_GROUP, "exit_group"},
	{unix.SYS_WAIT4, "wait4"},
	{unix.SYS_WAITID, "waitid"}, // Go's os package: waitid(P_PIDFD)
	{unix.SYS_KILL, "kill"},
	{unix.SYS_TKILL, "tkill"},
	{unix.SYS_TGKILL, "tgkill"},
	{unix.SYS_PIDFD_OPEN, "pidfd_open"},               // Go's os package
	{unix.SYS_PIDFD_SEND_SIGNAL, "pidfd_send_signal"}, // Go's os package
	{unix.SYS_PROCESS_MRELEASE, "process_mrelease"},
	{unix.SYS_RT_SIGACTION, "rt_sigaction"},
	{unix.SYS_RT_SIGPROCMASK, "rt_sigprocmask"},
	{unix.SYS_RT_SIGRETURN, "rt_sigreturn"},
	{unix.SYS_RT_SIGPENDING, "rt_sigpending"},
	{unix.SYS_RT_SIGTIMEDWAIT, "rt_sigtimedwait"},
	{unix.SYS_RT_SIGQUEUEINFO, "rt_sigqueueinfo"},
	{unix.SYS_RT_TGSIGQUEUEINFO, "rt_tgsigqueueinfo"},
	{unix.SYS_RT_SIGSUSPEND, "rt_sigsuspend"},
	{unix.SYS_SIGALTSTACK, "sigaltstack"},
	{unix.SYS_PAUSE, "pause"},
	{unix.SYS_RESTART_SYSCALL, "restart_syscall"},
	{unix.SYS_FUTEX, "futex"},
	{unix.SYS_FUTEX_WAITV, "futex_waitv"},
	{unix.SYS_FUTEX_WAKE, "futex_wake"},       // newer; futex2
	{unix.SYS_FUTEX_WAIT, "futex_wait"},       // newer; futex2
	{unix.SYS_FUTEX_REQUEUE, "futex_requeue"}, // newer; futex2
	{unix.SYS_SET_ROBUST_LIST, "set_robust_list"},
	{unix.SYS_GET_ROBUST_LIST, "get_robust_list"},
	{unix.SYS_SET_TID_ADDRESS, "set_tid_address"},
	{unix.SYS_SET_THREAD_AREA, "set_thread_area"},
	{unix.SYS_GET_THREAD_AREA, "get_thread_area"},
	{unix.SYS_ARCH_PRCTL, "arch_prctl"},
	{unix.SYS_MODIFY_LDT, "modify_ldt"}, // Docker allows it on x86
	{unix.SYS_RSEQ, "rseq"},
	{unix.SYS_LANDLOCK_CREATE_RULESET, "landlock_create_ruleset"},
	{unix.SYS_LANDLOCK_ADD_RULE, "landlock_add_rule"},
	{unix.SYS_LANDLOCK_RESTRICT_SELF, "landlock_restrict_self"},
	{unix.SYS_CAPGET, "capget"},
	{unix.SYS_CAPSET, "capset"},
	{unix.SYS_URETPROBE, "uretprobe"}, // only works from the kernel's uprobe trampoline
	{unix.SYS_UPROBE, "uprobe"},       // likewise

	// Identity, sessions and limits.
	{unix.SYS_GETPID, "getpid"},
	{unix.SYS_GETPPID, "getppid"},
	{unix.SYS_GETTID, "gettid"},
	{unix.SYS_GETUID, "getuid"},
	{unix.SYS_GETEUID, "geteuid"},
	{unix.SYS_GETGID, "getgid"},
	{unix.SYS_GETEGID, "getegid"},
	{unix.SYS_GETRESUID, "getresuid"},
	{unix.SYS_GETRESGID, "getresgid"},
	{unix.SYS_GETGROUPS, "getgroups"},
	{unix.SYS_SETUID, "setuid"},
	{unix.SYS_SETGID, "setgid"},
	{unix.SYS_SETREUID, "setreuid"},
	{unix.SYS_SETREGID, "setregid"},
	{unix.SYS_SETRESUID, "setresuid"},
	{unix.SYS_SETRESGID, "setresgid"},
	{unix.SYS_SETFSUID, "setfsuid"},
	{unix.SYS_SETFSGID, "setfsgid"},
	{unix.SYS_SETGROUPS, "setgroups"},
	{unix.SYS_GETPGID, "getpgid"},
	{unix.SYS_GETPGRP, "getpgrp"},
	{unix.SYS_SETPGID, "setpgid"},
	{unix.SYS_GETSID, "getsid"},
	{unix.SYS_SETSID, "setsid"},
	{unix.SYS_GETRLIMIT, "getrlimit"},
	{unix.SYS_GETRUSAGE, "getrusage"},
	{unix.SYS_GETPRIORITY, "getpriority"},
	{unix.SYS_SETPRIORITY, "setpriority"},
	{unix.SYS_IOPRIO_GET, "ioprio_get"},
	{unix.SYS_IOPRIO_SET, "ioprio_set"},

	// Scheduling.
	{unix.SYS_SCHED_YIELD, "sched_yield"},
	{unix.SYS_SCHED_SETPARAM, "sched_setparam"},
	{unix.SYS_SCHED_GETPARAM, "sched_getparam"},
	{unix.SYS_SCHED_SETSCHEDULER, "sched_setscheduler"},
	{unix.SYS_SCHED_GETSCHEDULER, "sched_getscheduler"},
	{unix.SYS_SCHED_GET_PRIORITY_MAX, "sched_get_priority_max"},
	{unix.SYS_SCHED_GET_PRIORITY_MIN, "sched_get_priority_min"},
	{unix.SYS_SCHED_RR_GET_INTERVAL, "sched_rr_get_interval"},
	{unix.SYS_SCHED_SETAFFINITY, "sched_setaffinity"},
	{unix.SYS_SCHED_GETAFFINITY, "sched_getaffinity"},
	{unix.SYS_SCHED_SETATTR, "sched_setattr"},
	{unix.SYS_SCHED_GETATTR, "sched_getattr"},
	{unix.SYS_GETCPU, "getcpu"},

	// Time. Reading clocks only: setting them is denied. adjtimex and
	// clock_adjtime are allowed as in Docker; they modify the clock only
	// with CAP_SYS_TIME in the initial user namespace.
	{unix.SYS_TIME, "time"},
	{unix.SYS_GETTIMEOFDAY, "gettimeofday"},
	{unix.SYS_CLOCK_GETTIME, "clock_gettime"},
	{unix.SYS_CLOCK_GETRES, "clock_getres"},
	{unix.SYS_CLOCK_NANOSLEEP, "clock_nanosleep"},
	{unix.SYS_NANOSLEEP, "nanosleep"},
	{unix.SYS_ADJTIMEX, "adjtimex"},
	{unix.SYS_CLOCK_ADJTIME, "clock_adjtime"},
	{unix.SYS_ALARM, "alarm"},
	{unix.SYS_GETITIMER, "getitimer"},
	{unix.SYS_SETITIMER, "setitimer"},
	{unix.SYS_TIMER_CREATE, "timer_create"},
	{unix.SYS_TIMER_SETTIME, "timer_settime"},
	{unix.SYS_TIMER_GETTIME, "timer_gettime"},
	{unix.SYS_TIMER_GETOVERRUN, "timer_getoverrun"},
	{unix.SYS_TIMER_DELETE, "timer_delete"},
	{unix.SYS_TIMES, "times"},

	// System information.
	{unix.SYS_UNAME, "uname"},
	{unix.SYS_SYSINFO, "sysinfo"},
	{unix.SYS_GETRANDOM, "getrandom"},

	// Sockets (socket and setsockopt are in filtered).
	{unix.SYS_SOCKETPAIR, "socketpair"},
	{unix.SYS_CONNECT, "connect"},
	{unix.SYS_ACCEPT, "accept"},
	{unix.SYS_ACCEPT4, "accept4"},
	{unix.SYS_BIND, "bind"},
	{unix.SYS_LISTEN, "listen"},
	{unix.SYS_SHUTDOWN, "shutdown"},
	{unix.SYS_GETSOCKNAME, "getsockname"},
	{unix.SYS_GETPEERNAME, "getpeername"},
	{unix.SYS_GETSOCKOPT, "getsockopt"},
	{unix.SYS_SENDTO, "sendto"},
	{unix.SYS_RECVFROM, "recvfrom"},
	{unix.SYS_SENDMSG, "sendmsg"},
	{unix.SYS_RECVMSG, "recvmsg"},
	{unix.SYS_SENDMMSG, "sendmmsg"},
	{unix.SYS_RECVMMSG, "recvmmsg"},

	// System V and POSIX IPC (private to the sandbox's IPC namespace).
	{unix.SYS_SHMGET, "shmget"},
	{unix.SYS_SHMAT, "shmat"},
	{unix.SYS_SHMCTL, "shmctl"},
	{unix.SYS_SHMDT, "shmdt"},
	{unix.SYS_SEMGET, "semget"},
	{unix.SYS_SEMOP, "semop"},
	{unix.SYS_SEMCTL, "semctl"},
	{unix.SYS_SEMTIMEDOP, "semtimedop"},
	{unix.SYS_MSGGET, "msgget"},
	{unix.SYS_MSGSND, "msgsnd"},
	{unix.SYS_MSGRCV, "msgrcv"},
	{unix.SYS_MSGCTL, "msgctl"},
	{unix.SYS_MQ_OPEN, "mq_open"},
	{unix.SYS_MQ_UNLINK, "mq_unlink"},
	{unix.SYS_MQ_TIMEDSEND, "mq_timedsend"},
	{unix.SYS_MQ_TIMEDRECEIVE, "mq_timedreceive"},
	{unix.SYS_MQ_NOTIFY, "mq_notify"},
	{unix.SYS_MQ_GETSETATTR, "mq_getsetattr"},
}

// filtered are the syscalls whose verdict depends on their arguments (or that
// get an errno other than EPERM). filter.go emits one block for each action.
var filtered = []struct {
	sc
	act action
}{
	{sc{unix.SYS_CLONE, "clone"}, actClone},
	// clone3 passes its flags in a struct in memory, which seccomp cannot
	// read, so it cannot be filtered like clone. It gets ENOSYS rather than
	// EPERM: glibc (and other libcs) take ENOSYS to mean "kernel too old" and
	// fall back to clone, whose flags the filter can check. Go only uses
	// clone3 for SysProcAttr.UseCgroupFD and CLONE_NEWTIME, neither of which
	// can work inside the sandbox anyway.
	{sc{unix.SYS_CLONE3, "clone3"}, actENOSYS},
	// Legacy AIO (io_uring is denied) gets ENOSYS, as on a kernel built
	// without it, which libaio's users (databases, fio) fall back from:
	// its contexts count against fs.aio-max-nr, one counter for the whole
	// host that no namespace or cgroup divides, so one sandbox holding
	// them all stopped AIO for the host and every other sandbox.
	{sc{unix.SYS_IO_SETUP, "io_setup"}, actENOSYS},
	{sc{unix.SYS_IO_DESTROY, "io_destroy"}, actENOSYS},
	{sc{unix.SYS_IO_GETEVENTS, "io_getevents"}, actENOSYS},
	{sc{unix.SYS_IO_PGETEVENTS, "io_pgetevents"}, actENOSYS},
	{sc{unix.SYS_IO_SUBMIT, "io_submit"}, actENOSYS},
	{sc{unix.SYS_IO_CANCEL, "io_cancel"}, actENOSYS},
	{sc{unix.SYS_SOCKET, "socket"}, actSocket},
	{sc{unix.SYS_IOCTL, "ioctl"}, actIoctl},
	{sc{unix.SYS_PERSONALITY, "personality"}, actPersonality},
	{sc{unix.SYS_SETSOCKOPT, "setsockopt"}, actSetsockopt},
	// A filter of the sandbox's own, or strict mode, fails with EINVAL, as
	// on a kernel built without seccomp filters (see filter.go): the
	// kernel writes a record to the host's audit log for every call its
	// SECCOMP_RET_LOG lets through and every kill, which no namespace or
	// cgroup holds. Querying (GET_ACTION_AVAIL, GET_NOTIF_SIZES,
	// PR_GET_SECCOMP) still works.
	{sc{unix.SYS_SECCOMP, "seccomp"}, actSeccomp},
	{sc{unix.SYS_PRCTL, "prctl"}, actPrctl},
	// RLIMIT_CORE stays as the agent set it (1 byte: no core dump), see
	// filter.go; every other limit, and reading this one, as the kernel
	// allows.
	{sc{unix.SYS_SETRLIMIT, "setrlimit"}, actSetrlimit},
	{sc{unix.SYS_PRLIMIT64, "prlimit64"}, actPrlimit},
}
