package process

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/seccomp"
)

// Init is the child side of the wall, run by cage-agent as the sandbox's
// PID 1 before it serves. It returns the agent's listener and configuration
// once the sandbox is sealed; after an error the caller must exit.
func Init() (net.Listener, agent.Config, error) {
	var cfg agent.Config
	spec, err := readSpec()
	if err != nil {
		return nil, cfg, err
	}
	// The host put this process in the sandbox's cgroups before sending the
	// spec; a new cgroup namespace now roots /proc/self/cgroup there.
	if err := allThreads(unix.SYS_UNSHARE, unix.CLONE_NEWCGROUP, 0, 0); err != nil {
		return nil, cfg, fmt.Errorf("cgroup namespace: %w", err)
	}
	// Opened while the host's paths are still reachable; read after pivot.
	limits, err := openLimitEvents(spec)
	if err != nil {
		return nil, cfg, err
	}
	steps := []struct {
		name string
		run  func() error
	}{
		{"root filesystem", func() error { return buildRoot(spec) }},
		{"pivot_root", func() error { return pivot(spec.Root) }},
		{"hostname", func() error { return unix.Sethostname([]byte(spec.Hostname)) }},
		{"loopback", loopbackUp},
		{"privileges", dropPrivileges},
		{"landlock", func() error { _, err := applyLandlock(); return err }},
		{"seccomp", seccomp.Install},
	}
	for _, s := range steps {
		if err := s.run(); err != nil {
			return nil, cfg, fmt.Errorf("%s: %w", s.name, err)
		}
	}
	l, err := net.FileListener(os.NewFile(fdListener, "agent.sock"))
	if err != nil {
		return nil, cfg, fmt.Errorf("agent listener: %w", err)
	}
	cfg = agent.Config{
		Token:       spec.Token,
		DefaultUser: spec.UserName,
		Env:         spec.Env,
		MaxOutput:   spec.MaxOutput,
		Limits:      limits,
	}
	return l, cfg, nil
}

func readSpec() (*initSpec, error) {
	f := os.NewFile(fdSpec, "spec")
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("read sandbox spec: %w", err)
	}
	if len(data) == 0 {
		return nil, fmt.Errorf("no sandbox spec: the host gave up on this sandbox")
	}
	spec := &initSpec{}
	if err := json.Unmarshal(data, spec); err != nil {
		return nil, fmt.Errorf("decode sandbox spec: %w", err)
	}
	return spec, nil
}

// limitEvents reads the host cgroup's counters through descriptors opened
// before pivot_root; the files themselves are never visible in the sandbox.
type limitEvents struct{ oom, pids *os.File }

func openLimitEvents(spec *initSpec) (*limitEvents, error) {
	le := &limitEvents{}
	var err error
	if spec.OOMEvents != "" {
		if le.oom, err = os.Open(spec.OOMEvents); err != nil {
			return nil, fmt.Errorf("open OOM counter: %w", err)
		}
	}
	if spec.PidsEvents != "" {
		if le.pids, err = os.Open(spec.PidsEvents); err != nil {
			return nil, fmt.Errorf("open pids counter: %w", err)
		}
	}
	return le, nil
}

func (le *limitEvents) OOMKills() uint64 {
	if le.oom == nil {
		return 0
	}
	return cgroups.Counter(le.oom, "oom_kill")
}

func (le *limitEvents) PidsMax() uint64 {
	if le.pids == nil {
		return 0
	}
	return cgroups.Counter(le.pids, "max")
}
