//go:build linux && amd64

package seccomp

import "golang.org/x/sys/unix"

// denied lists, for documentation and for the tests, syscalls of the x86_64
// table that deliberately get EPERM. The filter does not read this list:
// everything not in allowed or filtered is denied by default. The tests check
// that no number here is also allowed.
var denied = []sc{
	// Kernel attack surface with a long history of bugs, or kernel
	// introspection. Docker allowed io_uring until 2023 and still allows
	// memfd_secret and name_to_handle_at.
	{unix.SYS_IO_URING_SETUP, "io_uring_setup"},
	{unix.SYS_IO_URING_ENTER, "io_uring_enter"},
	{unix.SYS_IO_URING_REGISTER, "io_uring_register"},
	{unix.SYS_USERFAULTFD, "userfaultfd"},
	{unix.SYS_BPF, "bpf"},
	{unix.SYS_PERF_EVENT_OPEN, "perf_event_open"},
	{unix.SYS_MEMFD_SECRET, "memfd_secret"},
	{unix.SYS_LOOKUP_DCOOKIE, "lookup_dcookie"},
	{unix.SYS_LSM_GET_SELF_ATTR, "lsm_get_self_attr"},
	{unix.SYS_LSM_SET_SELF_ATTR, "lsm_set_self_attr"},
	{unix.SYS_LSM_LIST_MODULES, "lsm_list_modules"},
	{unix.SYS_SYSLOG, "syslog"},
	{unix.SYS_SYSFS, "sysfs"},
	{unix.SYS_USTAT, "ustat"},
	{unix.SYS__SYSCTL, "_sysctl"},

	// Keyrings are not namespaced.
	{unix.SYS_ADD_KEY, "add_key"},
	{unix.SYS_REQUEST_KEY, "request_key"},
	{unix.SYS_KEYCTL, "keyctl"},

	// Inspecting or controlling other processes.
	{unix.SYS_PTRACE, "ptrace"},
	{unix.SYS_PROCESS_VM_READV, "process_vm_readv"},
	{unix.SYS_PROCESS_VM_WRITEV, "process_vm_writev"},
	{unix.SYS_PROCESS_MADVISE, "process_madvise"},
	{unix.SYS_PIDFD_GETFD, "pidfd_getfd"},
	{unix.SYS_KCMP, "kcmp"},

	// Mounts and namespaces.
	{unix.SYS_MOUNT, "mount"},
	{unix.SYS_UMOUNT2, "umount2"},
	{unix.SYS_PIVOT_ROOT, "pivot_root"},
	{unix.SYS_MOVE_MOUNT, "move_mount"},
	{unix.SYS_OPEN_TREE, "open_tree"},
	{unix.SYS_OPEN_TREE_ATTR, "open_tree_attr"},
	{unix.SYS_FSOPEN, "fsopen"},
	{unix.SYS_FSCONFIG, "fsconfig"},
	{unix.SYS_FSMOUNT, "fsmount"},
	{unix.SYS_FSPICK, "fspick"},
	{unix.SYS_MOUNT_SETATTR, "mount_setattr"},
	{unix.SYS_STATMOUNT, "statmount"},
	{unix.SYS_LISTMOUNT, "listmount"},
	{unix.SYS_UNSHARE, "unshare"},
	{unix.SYS_SETNS, "setns"},
	{unix.SYS_LISTNS, "listns"},
	{unix.SYS_NAME_TO_HANDLE_AT, "name_to_handle_at"},
	{unix.SYS_OPEN_BY_HANDLE_AT, "open_by_handle_at"},
	{unix.SYS_FANOTIFY_INIT, "fanotify_init"},
	{unix.SYS_QUOTACTL, "quotactl"},
	{unix.SYS_QUOTACTL_FD, "quotactl_fd"},

	// Kernel modules, kexec, power, swap and accounting.
	{unix.SYS_INIT_MODULE, "init_module"},
	{unix.SYS_FINIT_MODULE, "finit_module"},
	{unix.SYS_DELETE_MODULE, "delete_module"},
	{unix.SYS_CREATE_MODULE, "create_module"},
	{unix.SYS_GET_KERNEL_SYMS, "get_kernel_syms"},
	{unix.SYS_QUERY_MODULE, "query_module"},
	{unix.SYS_KEXEC_LOAD, "kexec_load"},
	{unix.SYS_KEXEC_FILE_LOAD, "kexec_file_load"},
	{unix.SYS_REBOOT, "reboot"},
	{unix.SYS_SWAPON, "swapon"},
	{unix.SYS_SWAPOFF, "swapoff"},
	{unix.SYS_ACCT, "acct"},
	{unix.SYS_NFSSERVCTL, "nfsservctl"},
	{unix.SYS_USELIB, "uselib"},
	{unix.SYS_VHANGUP, "vhangup"},

	// Host identity and time.
	{unix.SYS_SETHOSTNAME, "sethostname"}, // the agent sets it before installing the filter
	{unix.SYS_SETDOMAINNAME, "setdomainname"},
	{unix.SYS_SETTIMEOFDAY, "settimeofday"},
	{unix.SYS_CLOCK_SETTIME, "clock_settime"},

	// Raw hardware access.
	{unix.SYS_IOPL, "iopl"},
	{unix.SYS_IOPERM, "ioperm"},

	// NUMA policy: Docker allows these only with CAP_SYS_NICE.
	{unix.SYS_MBIND, "mbind"},
	{unix.SYS_SET_MEMPOLICY, "set_mempolicy"},
	{unix.SYS_GET_MEMPOLICY, "get_mempolicy"},
	{unix.SYS_MIGRATE_PAGES, "migrate_pages"},
	{unix.SYS_MOVE_PAGES, "move_pages"},
	{unix.SYS_SET_MEMPOLICY_HOME_NODE, "set_mempolicy_home_node"},

	// Unimplemented slots and calls too new to have been reviewed.
	{unix.SYS_GETPMSG, "getpmsg"},
	{unix.SYS_PUTPMSG, "putpmsg"},
	{unix.SYS_AFS_SYSCALL, "afs_syscall"},
	{unix.SYS_TUXCALL, "tuxcall"},
	{unix.SYS_SECURITY, "security"},
	{unix.SYS_VSERVER, "vserver"},
	{unix.SYS_RSEQ_SLICE_YIELD, "rseq_slice_yield"},
}
