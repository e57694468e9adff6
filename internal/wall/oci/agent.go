package oci

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/seal"
	"github.com/cagehq/cage/internal/wall/process"
)

// Child side: `cage-agent serve`, the container's init under runc or runsc.
// The runtime has made the namespaces, mounts, cgroups and the user; the
// agent then seals itself exactly as on the process wall and serves.

// serveSpec is what the host passes the agent on fd 3.
type serveSpec struct {
	// WritableRoot: the root is an image template's overlay (see
	// seal.Options).
	WritableRoot bool              `json:"writable_root,omitempty"`
	Token        string            `json:"token"`
	Env          map[string]string `json:"env"`
	MaxOutput    int64             `json:"max_output"`
	UserName     string            `json:"user_name"`
	AgentUID     int               `json:"agent_uid"`
	Threads      int               `json:"threads"`
	// Listen is a unix socket path to listen on; empty: the listening
	// socket is fd 4 (runc passes it; gVisor cannot, and listens on a path
	// shared with the host instead).
	Listen string `json:"listen,omitempty"`
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
}

// Serve is cage-agent's `serve` mode. It returns only on error.
func Serve() error {
	f := os.NewFile(3, "spec")
	data, err := io.ReadAll(io.LimitReader(f, 1<<20))
	f.Close()
	if err != nil {
		return fmt.Errorf("read the spec: %w", err)
	}
	var spec serveSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		return fmt.Errorf("decode the spec: %w", err)
	}
	// Nothing inherited may reach the commands.
	_ = unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC)
	var l net.Listener
	if spec.Listen != "" {
		_ = os.Remove(spec.Listen)
		if l, err = net.Listen("unix", spec.Listen); err != nil {
			return fmt.Errorf("listen: %w", err)
		}
	} else {
		lf := os.NewFile(4, "agent.sock")
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
	if spec.LoopbackUp {
		if err := process.LoopbackUp(); err != nil {
			return err
		}
	}
	cfg := agent.Config{
		Token: spec.Token, DefaultUser: spec.UserName, Env: spec.Env, MaxOutput: spec.MaxOutput,
		Limits: cgroups.EventFiles{OOM: fileOrNil(spec.OOMFD), Pids: fileOrNil(spec.PidsFD)}, SpawnThreadSetup: seal.SpawnThread,
		AgentUID: spec.AgentUID, Threads: spec.Threads,
	}
	srv, err := agent.New(cfg)
	if err != nil {
		return err
	}
	if _, err := seal.Seal(seal.Options{AgentUID: spec.AgentUID, WritableRoot: spec.WritableRoot}); err != nil {
		return err
	}
	return srv.Serve(l)
}

func fileOrNil(fd int) *os.File {
	if fd < 0 {
		return nil
	}
	return os.NewFile(uintptr(fd), "cgroup-events")
}
