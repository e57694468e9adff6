// Package seccomp builds and installs cage's syscall filter: a classic-BPF
// seccomp program, written by hand in pure Go (no cgo, no libseccomp).
//
// The filter is the last line of defence for hostile code inside a sandbox,
// which may run as root (or as uid 1000) inside a user namespace. It is
// installed by the in-sandbox agent, after the agent's own privileged setup
// (such as sethostname), and is inherited by every process the agent starts.
// The agent is itself a static Go binary and keeps running under the filter.
//
// Policy (x86_64 only):
//
//   - Any architecture other than AUDIT_ARCH_X86_64 (the i386 ABI reached
//     with int 0x80 or sysenter) and any x32 syscall number gets EPERM.
//   - Syscalls are allowlisted; everything else gets EPERM. The filter never
//     kills or traps, so probing programs see an ordinary error. The
//     allowlist is Docker's default profile (see list.go), minus kernel
//     attack surface a sandbox does not need (io_uring, bpf, perf_event_open,
//     userfaultfd, keyrings, ptrace and process_vm_*, the mount and namespace
//     calls, modules, kexec, ...).
//   - clone is allowed only without namespace flags; clone3 gets ENOSYS so
//     that libcs fall back to clone; socket denies AF_ALG, AF_VSOCK,
//     AF_PACKET, AF_KEY and raw IP sockets; ioctl denies TIOCSTI and
//     TIOCLINUX; personality allows only the values Docker allows.
//
// The syscall numbers are matched with a binary search over runs of numbers
// that share an action, so a typical call costs about a dozen BPF
// instructions rather than a walk down a list of 300.
package seccomp
