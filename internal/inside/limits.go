package inside

import (
	"fmt"
	"os"
	"syscall"
)

// MaxOpenFiles is a sandbox's limit of open files per process, or the
// host's hard limit where that is lower.
const MaxOpenFiles = 65536

// LimitOpenFiles sets the agent's open files limit, which every command
// inherits, to MaxOpenFiles or the hard limit it was given if lower, soft
// and hard alike, so that every wall gives commands the same limit
// whatever soft limit the host's cage ran with. Raising the soft limit up
// to the hard one and lowering the hard one need no privilege. syscall's
// Setrlimit, not unix's: it also tells Go's runtime not to give commands
// back the soft limit the agent started with.
func LimitOpenFiles() error {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return fmt.Errorf("open files limit: %w", err)
	}
	n := min(rl.Max, MaxOpenFiles)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: n, Max: n}); err != nil {
		return fmt.Errorf("open files limit: %w", err)
	}
	return nil
}

// CoreLimit is RLIMIT_CORE, soft and hard, for the agent and every
// command: 1 byte, the value for which the kernel skips a pipe
// core_pattern (systemd-coredump, apport) and below the page a core file
// needs, so that no process of a sandbox ever dumps core. Where the
// host's core_pattern is a pipe, the kernel otherwise runs its helper on
// the host, as root and outside the sandbox's cgroups, for every process
// that dies of a core-dumping signal, and hands it the process's whole
// memory, whatever RLIMIT_CORE is but 1 (0 does not stop a pipe). The
// commands' seccomp filter keeps them from changing it.
const CoreLimit = 1

// LimitCoreDumps sets RLIMIT_CORE to CoreLimit, soft and hard.
func LimitCoreDumps() error {
	if err := syscall.Setrlimit(syscall.RLIMIT_CORE, &syscall.Rlimit{Cur: CoreLimit, Max: CoreLimit}); err != nil {
		return fmt.Errorf("core dump limit: %w", err)
	}
	return nil
}

// AgentThreads is how many threads the agent may hold beside the
// workload: the pids limit is raised by as much, so that the workload's
// budget is what was asked. Where the workload has a pids group of its own
// (JoinWorkload) the agent starts them as it needs them; elsewhere it takes
// them before it serves.
const AgentThreads = 20

// JoinWorkload returns setup preceded by a move of the calling thread into
// the workload's pids group, whose tasks file the host opened (the kernel
// checks a move against the opener's credentials): the agent's spawning
// thread runs it, so that every process it forks is born there, counted
// against the workload's budget, while the agent's other threads stay in
// the sandbox's group (the Go runtime never starts a thread from a locked
// one). The thread names itself "0": a thread that moves itself does not
// take the kernel's global cgroup_threadgroup_rwsem, whose first writer
// after an idle spell waits for an RCU grace period (by its id, a cold
// create waited some 8 ms more).
func JoinWorkload(tasks *os.File, setup func() error) func() error {
	return func() error {
		_, err := tasks.WriteString("0")
		tasks.Close()
		if err != nil {
			return fmt.Errorf("move the spawning thread into the workload's pids group: %w", err)
		}
		return setup()
	}
}

// InodesFor sizes the disk's inode table: one per 8 KiB, at least 4096.
func InodesFor(bytes int64) int64 { return max(4096, bytes/8192) }
