package child

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/seal"
	"github.com/cagehq/cage/internal/trace"
)

// Child is the sandbox's side of the wall, set up by Init.
type Child struct {
	Listener net.Listener
	Config   agent.Config // the agent's configuration, SpawnThreadSetup included
	spec     *InitSpec
	specs    *json.Decoder // the spec pipe; the start document comes later
	specFile *os.File
}

// Init is the child side of the wall, run by cage-agent as the sandbox's
// PID 1: it waits for the spec and takes what must be taken while the host's
// paths are reachable. The caller then calls Build (which builds the root
// and enters it) and, at the same time, builds the agent (whose spawning
// thread runs Config.SpawnThreadSetup); then Seal, then serve. After an
// error the caller must exit.
func Init() (*Child, error) {
	// Inherited descriptors must not reach the commands: the uid-range lock
	// (one of them could release it) is kept, close-on-exec, for as long as
	// the agent lives, so the range stays reserved even if the host's cage
	// process dies and a new one adopts the sandbox.
	unix.CloseOnExec(fdIDLock)
	// Anything else inherited (cage makes its own inherited descriptors
	// close-on-exec, but a caller may start the agent differently) must not
	// reach the commands either.
	_ = unix.CloseRange(fdIDLock+1, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC)
	if err := inside.LimitOpenFiles(); err != nil {
		return nil, err
	}
	if err := inside.LimitCoreDumps(); err != nil {
		return nil, err
	}
	specFile := os.NewFile(fdSpec, "spec")
	specs := json.NewDecoder(io.LimitReader(specFile, 1<<20))
	spec := &InitSpec{}
	if err := readDoc(specs, spec); err != nil {
		return nil, err
	}
	trace.Set(spec.Debug)
	trace.Mark("spec read")
	// The host put this process in the sandbox's cgroups before sending the
	// spec; a new cgroup namespace now roots /proc/self/cgroup there.
	if err := seal.AllThreads(unix.SYS_UNSHARE, unix.CLONE_NEWCGROUP, 0, 0); err != nil {
		return nil, fmt.Errorf("cgroup namespace: %w", err)
	}
	// Opened while the host's paths are still reachable; read after pivot.
	limits, err := openLimitEvents(spec)
	if err != nil {
		return nil, err
	}
	lf := os.NewFile(fdListener, "agent.sock")
	l, err := net.FileListener(lf) // a close-on-exec duplicate
	lf.Close()
	if err != nil {
		return nil, fmt.Errorf("agent listener: %w", err)
	}
	setup, threads := spawnSetup(spec.Build), inside.AgentThreads
	if spec.WorkloadTasks > 0 {
		// The workload's processes are counted apart from the agent's
		// threads (the host made their group): the agent needs none ahead.
		setup, threads = inside.JoinWorkload(os.NewFile(uintptr(spec.WorkloadTasks), "workload tasks"), setup), 0
	}
	return &Child{Listener: l, spec: spec, specs: specs, specFile: specFile, Config: agent.Config{
		OneShot:          spec.Run != nil,
		DefaultUser:      spec.UserName,
		Limits:           limits,
		SpawnThreadSetup: setup,
		AgentUID:         agentUID,
		Threads:          threads,
		Volumes:          spec.Volumes,
	}}, nil
}

func spawnSetup(build bool) func() error {
	if build {
		return seal.SpawnThreadForBuild
	}
	return seal.SpawnThread
}

// Build assembles the sandbox's root, enters it, names the host and brings
// the loopback up.
func (c *Child) Build() error {
	spec := c.spec
	steps := []struct {
		name string
		run  func() error
	}{
		{"root filesystem", func() error { return buildRoot(spec) }},
		{"pivot_root", func() error { return pivot(spec.Root, spec.Image != "") }},
		{"hostname", func() error { return unix.Sethostname([]byte(spec.Hostname)) }},
		{"loopback", inside.LoopbackUp},
		{"resolv.conf", func() error {
			if spec.ResolvConf == "" {
				return nil // the root's own says there is no network
			}
			return writeRootFile("/run/cage/resolv.conf", spec.ResolvConf, spec.Image != "")
		}},
	}
	for _, s := range steps {
		trace.Mark(s.name)
		if err := s.run(); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// Seal takes every privilege the agent does not need, for good: Landlock,
// its own uid with capabilities down to agentCaps, no_new_privs, then the
// seccomp filter (whose TSYNC also spreads no_new_privs to every thread).
func (c *Child) Seal() error {
	if _, err := seal.Seal(seal.Options{AgentUID: agentUID, DieWithParent: c.spec.DieWithParent, Trace: trace.Mark,
		WritableRoot: c.spec.Image != "", Writable: c.spec.Volumes}); err != nil {
		return err
	}
	if trace.On() {
		d, _ := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
		trace.Mark(fmt.Sprintf("sealed (dumpable=%d)", d))
	}
	return nil
}

func readDoc(dec *json.Decoder, v any) error {
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("no sandbox spec: the host gave up on this sandbox")
		}
		return fmt.Errorf("read sandbox spec: %w", err)
	}
	return nil
}

// OneShot is the command the sandbox was made for (InitSpec.Run), nil
// when it serves requests. Its descriptors are taken once.
func (c *Child) OneShot() *agent.OneShot {
	r := c.spec.Run
	if r == nil || r.FD <= fdIDLock {
		return nil
	}
	fd := func(i int, name string) *os.File { return os.NewFile(uintptr(r.FD+i), name) }
	return &agent.OneShot{Cmd: r.Cmd, Args: r.Args, Cwd: r.Cwd, User: r.User, Env: r.Env,
		Stdin: fd(0, "stdin"), Stdout: fd(1, "stdout"), Stderr: fd(2, "stderr"),
		Control: fd(3, "control"), Status: fd(4, "status")}
}

// StartPending says whether the request's own settings (the start
// document) have come already: then the sandbox was asked for as it was
// made, not kept in a pool, and anything done before WaitStart delays it.
func (c *Child) StartPending() bool {
	// What the decoder read past the first document: at least the newline
	// that ends it.
	if rest, err := io.ReadAll(c.specs.Buffered()); err == nil && len(bytes.TrimSpace(rest)) > 0 {
		return true
	}
	fds := []unix.PollFd{{Fd: int32(c.specFile.Fd()), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}

// WaitStart waits for the request's own settings (the second document),
// which come once the child is sealed, and returns them. Sizes other than
// the ones it was built with are refused: it can no longer remount (an
// image root's disk is the host's, which the host resized).
func (c *Child) WaitStart() (token string, env map[string]string, maxOutput int64, err error) {
	st := &StartSpec{}
	err = readDoc(c.specs, st)
	c.specFile.Close()
	if err != nil {
		return "", nil, 0, err
	}
	trace.Mark("start read")
	if (c.spec.Image == "" && (st.DiskBytes != c.spec.DiskBytes || st.DiskInodes != c.spec.DiskInodes)) || st.ShmBytes != c.spec.ShmBytes {
		return "", nil, 0, fmt.Errorf("the host asked a sealed sandbox for other sizes (disk %d, shm %d; built with %d, %d)",
			st.DiskBytes, st.ShmBytes, c.spec.DiskBytes, c.spec.ShmBytes)
	}
	return st.Token, st.Env, st.MaxOutput, nil
}

// openLimitEvents opens the host cgroup's counters before pivot_root; the
// files themselves are never visible in the sandbox.
func openLimitEvents(spec *InitSpec) (cgroups.EventFiles, error) {
	var ev cgroups.EventFiles
	var err error
	if spec.OOMEvents != "" {
		if ev.OOM, err = os.Open(spec.OOMEvents); err != nil {
			return ev, fmt.Errorf("open OOM counter: %w", err)
		}
	}
	if spec.PidsEvents != "" {
		if ev.Pids, err = os.Open(spec.PidsEvents); err != nil {
			return ev, fmt.Errorf("open pids counter: %w", err)
		}
	}
	return ev, nil
}

// writeRootFile writes a file of the read-only root: the root is made
// writable for the moment (nothing of the workload runs yet).
func writeRootFile(path, content string, writable bool) error {
	if writable {
		return os.WriteFile(path, []byte(content), 0o644)
	}
	rw := &unix.MountAttr{Attr_clr: unix.MOUNT_ATTR_RDONLY}
	if err := unix.MountSetattr(unix.AT_FDCWD, "/", 0, rw); err != nil {
		return err
	}
	err := os.WriteFile(path, []byte(content), 0o644)
	ro := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
	if err2 := unix.MountSetattr(unix.AT_FDCWD, "/", 0, ro); err2 != nil && err == nil {
		err = err2
	}
	return err
}
