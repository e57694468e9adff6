// Package seccomp builds and installs cage's syscall filter: a classic-BPF
// seccomp program, written by hand in pure Go (no cgo, no libseccomp).
//
// The filter is the last line of defence against hostile code inside a
// sandbox, which may run as root (or as uid 1000) inside a user namespace.
// The in-sandbox agent installs it after its own privileged setup (mounts,
// pivot_root, sethostname) and before serving; every process the agent
// starts inherits it. The agent is itself a static Go binary and keeps
// running under the filter.
//
// Policy (x86_64 only):
//
//   - Any architecture other than AUDIT_ARCH_X86_64 (that is, the i386 ABI
//     reached with int $0x80 or sysenter) and any x32 syscall number gets
//     EPERM.
//   - Syscalls are allowlisted; everything else gets EPERM. The filter never
//     kills or traps, so programs that probe for a feature see an ordinary
//     error. The allowlist (list.go) is Docker's default profile, minus
//     kernel attack surface a sandbox does not need (denied.go: io_uring,
//     bpf, perf_event_open, userfaultfd, keyrings, ptrace and process_vm_*,
//     the mount and namespace calls, modules, kexec, ...).
//   - clone is allowed only without namespace flags; clone3 gets ENOSYS so
//     that libcs fall back to clone; legacy AIO (io_setup, io_submit, ...)
//     gets ENOSYS, as on a kernel without it (its contexts count against
//     one host-wide limit, fs.aio-max-nr, that one sandbox could take);
//     socket denies AF_ALG, AF_VSOCK,
//     AF_PACKET, AF_KEY and raw IP sockets; ioctl denies TIOCSTI,
//     TIOCLINUX and TIOCSETD; personality allows only the values Docker allows
//     (filter.go).
//
// Syscall numbers are matched by a binary search over runs of numbers that
// share an action (a dozen instructions for a typical call, not a walk down a
// list of 300), assembled by the small label-resolving assembler in bpf.go.
// For calls allowed by number, the verdict depends only on arch and nr, which
// lets the kernel's seccomp action cache (Linux 5.11+) skip running the
// filter for them.
//
// On linux/arm64 and other architectures, Install and Program fail: a sandbox
// must not silently run without its filter.
package seccomp
