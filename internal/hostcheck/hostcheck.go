// Package hostcheck holds what `cage doctor` and the dashboard's host page
// say of the host without starting a sandbox: the kernel, root, user
// namespaces, cgroups, landlock, the mount API, the agent binary and the
// runc the runc wall runs.
package hostcheck

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/sandbox"
)

// Check is one fact of the host: whether it is fine, and what it is.
type Check struct {
	Name string `json:"name"`
	OK   bool   `json:"ok"`
	Info string `json:"info"`
}

// Host checks the host's facts, in cage doctor's order.
func Host() []Check {
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	root := os.Geteuid() == 0
	out := []Check{
		{"kernel", true, unix.ByteSliceToString(uts.Release[:])},
		{"root", root, ifElse(root, "yes", "no: cage needs root (run with sudo)")},
		userns(),
	}
	if cg, err := cgroups.Detect("cage"); err != nil {
		out = append(out, Check{"cgroups", false, err.Error()})
	} else {
		out = append(out, Check{"cgroups", true, cg.Mode.String()}, favorDynmods())
	}
	out = append(out, landlock(), mountAPI(), hostLimits())
	agent, err := sandbox.FindAgent()
	out = append(out, Check{"cage-agent", err == nil, ifElse(err == nil, agent, fmt.Sprint(err))})
	if c, ok := Runc(); ok {
		out = append(out, c)
	}
	return out
}

func ifElse(c bool, a, b string) string {
	if c {
		return a
	}
	return b
}

func userns() Check {
	if _, err := os.Stat("/proc/self/ns/user"); err != nil {
		return Check{"user namespaces", false, "the kernel has no user namespaces (CONFIG_USER_NS)"}
	}
	b, err := os.ReadFile("/proc/sys/user/max_user_namespaces")
	if err == nil && strings.TrimSpace(string(b)) == "0" {
		return Check{"user namespaces", false, "disabled: sysctl user.max_user_namespaces=0 (set it above 0)"}
	}
	return Check{"user namespaces", true, "available"}
}

func landlock() Check {
	v, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	if errno != 0 {
		return Check{"landlock", true, "absent (optional: the read-only mounts still hold; boot with lsm=...,landlock for a second lock)"}
	}
	return Check{"landlock", true, fmt.Sprintf("ABI %d", v)}
}

func mountAPI() Check {
	fd, err := unix.OpenTree(unix.AT_FDCWD, "/", unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return Check{"mount API", false, "open_tree/mount_setattr missing: the process wall needs Linux 5.12 or newer"}
	}
	unix.Close(fd)
	return Check{"mount API", true, "open_tree, mount_setattr"}
}

// favorDynmods reports whether cgroup migrations are cheap. Moving a
// process between cgroups takes a global lock whose first writer in a
// while waits for an RCU grace period (≈10 ms); with favordynmods it does
// not. The process wall starts its agents inside their groups
// (cgroups.Spawn), which takes that lock no more; the OCI walls' runtimes
// still move processes. Informational: cage changes no host setting.
func favorDynmods() Check {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return Check{"cgroup migration", true, "unknown"}
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, " - cgroup2 ") && strings.Contains(line, "favordynmods") {
			return Check{"cgroup migration", true, "fast (favordynmods)"}
		}
	}
	return Check{"cgroup migration", true, "no favordynmods: a runtime's first cgroup move after a pause waits ~10 ms for an RCU grace period (the process wall avoids it; mount cgroup2 with -o favordynmods for the others)"}
}

// hostLimits: the kernel's host-wide limits that every sandbox draws from
// (cage serve raises them at its start).
func hostLimits() Check {
	if low := sandbox.LowHostLimits(); len(low) > 0 {
		return Check{"host limits", false, "below what many sandboxes hold together (cage serve raises them): " + strings.Join(low, ", ")}
	}
	return Check{"host limits", true, "pid_max, threads-max, file-max and pty.max fit many sandboxes"}
}
