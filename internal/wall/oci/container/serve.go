// Package container is the OCI walls' inside half: `cage-agent serve`, the
// container's init under runc or runsc. The runtime has made the
// namespaces, mounts, cgroups and the user; the agent then seals itself
// exactly as on the process wall and serves. Its host half, package oci,
// writes the Spec defined here on the agent's descriptor 3, then its Start:
// a prepared sandbox's agent (a pool's) gets ready to serve and waits for
// the second document, which only the request that takes it sends.
package container

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/seal"
	"github.com/cagehq/cage/internal/wall/channel"
)

// Socket is the name of the host's socket in a gVisor sandbox's channel
// directory.
const Socket = "host.sock"

// Start is the request's part of the spec: the second document on
// descriptor 3.
type Start struct {
	Token     string            `json:"token"`
	Env       map[string]string `json:"env"`
	MaxOutput int64             `json:"max_output"`
}

// Spec is what the host passes the agent on descriptor 3, first.
type Spec struct {
	// WritableRoot: the root is an image template's overlay (see
	// seal.Options).
	WritableRoot bool   `json:"writable_root,omitempty"`
	UserName     string `json:"user_name"`
	AgentUID     int    `json:"agent_uid"`
	Threads      int    `json:"threads"`
	// Channel, when set (gVisor), is the directory of the host's socket
	// (package channel), which the agent connects to with ChannelKey;
	// otherwise the agent's listening socket is fd 4 (runc passes it;
	// gVisor cannot take a listening socket).
	Channel    string `json:"channel,omitempty"`
	ChannelKey []byte `json:"channel_key,omitempty"`
	// OOMFD and PidsFD are the host cgroup's counters (-1: not passed).
	OOMFD  int `json:"oom_fd"`
	PidsFD int `json:"pids_fd"`
	// LoopbackUp: the runtime leaves lo down (runc); gVisor brings it up.
	LoopbackUp bool `json:"loopback_up"`
	// LifelineFD, when not -1, is the read end of a pipe whose write end
	// the creator holds: at EOF the creator is gone (a cage run killed with
	// SIGKILL) and the agent exits, taking the sandbox down with it. The
	// runtime detaches containers, so no parent-death signal reaches them.
	LifelineFD int `json:"lifeline_fd"`
	// TrimDev: /dev is gVisor's, which holds every device its kernel has
	// (fuse, net/tun, char/): the agent leaves only sandboxDev.
	TrimDev bool `json:"trim_dev,omitempty"`
	// Volumes are where volumes are mounted (writable; never archived).
	Volumes []string `json:"volumes,omitempty"`
	// LockFD, when not -1 (gVisor), is the host's lock on the sandbox's
	// uid range and network slot, held for as long as the sandbox runs,
	// which the agent lets go at SIGUSR2: a checkpoint holds no host
	// descriptor but the standard streams (the host holds the lock then).
	LockFD int `json:"lock_fd,omitempty"`
	// WorkloadTasksFD, when not 0 (runc on cgroup v1), is the tasks file of
	// the workload's pids group (cgroups.SplitPids), which the spawning
	// thread joins (inside.JoinWorkload); the agent then takes no threads
	// ahead.
	WorkloadTasksFD int `json:"workload_tasks_fd,omitempty"`
}

// sandboxDev is what a sandbox's /dev holds on every wall (the process
// wall adds a core link): the harmless nodes, PTYs, shared memory and the
// descriptor links.
var sandboxDev = map[string]bool{"null": true, "zero": true, "full": true, "random": true, "urandom": true,
	"tty": true, "ptmx": true, "pts": true, "shm": true, "fd": true, "stdin": true, "stdout": true, "stderr": true}

// trimDev removes from dir (gVisor's /dev) whatever is not in
// sandboxDev. Nothing can make a device node again: that takes
// CAP_MKNOD, which neither the agent nor any command holds.
func trimDev(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("trim /dev: %w", err)
	}
	for _, e := range ents {
		if !sandboxDev[e.Name()] {
			if err := os.RemoveAll(dir + "/" + e.Name()); err != nil {
				return fmt.Errorf("trim /dev: %w", err)
			}
		}
	}
	return nil
}

// Serve is cage-agent's `serve` mode. It returns only on error.
func Serve() error {
	if err := inside.LimitOpenFiles(); err != nil {
		return err
	}
	if err := inside.LimitCoreDumps(); err != nil {
		return err
	}
	f := os.NewFile(3, "spec")
	dec := json.NewDecoder(io.LimitReader(f, 1<<20))
	var spec Spec
	if err := dec.Decode(&spec); err != nil {
		f.Close()
		return fmt.Errorf("read the spec: %w", err)
	}
	// Nothing inherited may reach the commands.
	_ = unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC)
	var l net.Listener
	if spec.Channel != "" {
		// The directory is opened now, before any command exists; the
		// agent reaches the host through this descriptor from then on.
		dir, err := os.OpenFile(spec.Channel, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return fmt.Errorf("channel: %w", err)
		}
		if l, err = channel.Connect(dir, Socket, spec.ChannelKey); err != nil {
			return fmt.Errorf("channel: %w", err)
		}
	} else {
		lf := os.NewFile(4, "agent.sock")
		var err error
		l, err = net.FileListener(lf)
		lf.Close()
		if err != nil {
			return fmt.Errorf("agent listener: %w", err)
		}
	}
	if spec.LifelineFD >= 0 {
		go func(f *os.File) {
			buf := make([]byte, 1)
			for {
				if _, err := f.Read(buf); err != nil {
					fmt.Fprintf(os.Stderr, "cage-agent: the sandbox's creator is gone (%v)\n", err)
					os.Exit(3) // PID 1 exits: every process of the sandbox dies
				}
			}
		}(os.NewFile(uintptr(spec.LifelineFD), "lifeline"))
	}
	if spec.LockFD > 0 {
		releaseOnSignal(os.NewFile(uintptr(spec.LockFD), "slot-lock"))
	}
	if spec.TrimDev {
		if err := trimDev("/dev"); err != nil {
			return err
		}
	}
	if spec.LoopbackUp {
		if err := inside.LoopbackUp(); err != nil {
			return err
		}
	}
	// Ready: the request's part comes now, or when a create takes the
	// prepared sandbox (a host that goes away first closes the pipe).
	var start Start
	err := dec.Decode(&start)
	f.Close()
	if err != nil {
		return fmt.Errorf("read the spec's start: %w", err)
	}
	setup, threads := seal.SpawnThread, spec.Threads
	if spec.WorkloadTasksFD > 0 {
		// The workload's processes are counted apart from the agent's
		// threads (the host made their group): none are needed ahead.
		setup, threads = inside.JoinWorkload(os.NewFile(uintptr(spec.WorkloadTasksFD), "workload tasks"), setup), 0
	}
	cfg := agent.Config{
		Token: start.Token, DefaultUser: spec.UserName, Env: start.Env, MaxOutput: start.MaxOutput,
		Limits: cgroups.EventFiles{OOM: fileOrNil(spec.OOMFD), Pids: fileOrNil(spec.PidsFD)}, SpawnThreadSetup: setup,
		AgentUID: spec.AgentUID, Threads: threads, Volumes: spec.Volumes,
	}
	srv, err := agent.New(cfg)
	if err != nil {
		return err
	}
	if _, err := seal.Seal(seal.Options{AgentUID: spec.AgentUID, WritableRoot: spec.WritableRoot, Writable: spec.Volumes}); err != nil {
		return err
	}
	return srv.Serve(l)
}

// releaseOnSignal closes f at the first SIGUSR2.
func releaseOnSignal(f *os.File) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, unix.SIGUSR2)
	go func() {
		<-sig
		f.Close()
	}()
}

func fileOrNil(fd int) *os.File {
	if fd < 0 {
		return nil
	}
	return os.NewFile(uintptr(fd), "cgroup-events")
}
