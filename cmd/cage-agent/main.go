// Command cage-agent runs inside every sandbox as its PID 1: it seals the
// sandbox (on the process wall, the child side of the wall's setup), then
// serves E2B's envd protocol to the host. It is a static binary
// (CGO_ENABLED=0): the process wall's setup needs every Go thread to take
// the same credentials, which cgo would prevent.
package main

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"

	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/spawner"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/vm/jail"
	"github.com/cagehq/cage/internal/wall/microvm/guest"
	"github.com/cagehq/cage/internal/wall/oci/container"
	"github.com/cagehq/cage/internal/wall/process/child"
)

func main() {
	if guest.IsGuestInit() {
		// The init of a microvm guest.
		err := guest.GuestServe()
		fmt.Fprintln(os.Stderr, "cage-agent:", err)
		guest.PowerOff()
		return
	}
	if len(os.Args) > 2 && os.Args[1] == jail.Arg {
		// The host runs this in QEMU's new namespaces: build its root,
		// drop to its uid, exec it (the microvm wall's jail).
		fail("qemu-jail", jail.Main(os.Args[2:]))
	}
	if len(os.Args) == 2 && os.Args[1] == "hold" {
		// The host runs this in a user namespace only to get hold of the
		// namespace (the map of an idmapped mount); it exits when its
		// standard input closes.
		_, _ = io.Copy(io.Discard, os.Stdin)
		return
	}
	if len(os.Args) == 2 && os.Args[1] == spawner.Arg {
		// On the host, beside the daemon: it starts the process wall's
		// agents (see package spawner).
		if err := spawner.Serve(spawner.FD); err != nil {
			fail("spawner", err)
		}
		return
	}
	if len(os.Args) == 2 && os.Args[1] == "serve" {
		// The OCI walls: runc or runsc made the container; seal and serve.
		if err := container.Serve(); err != nil {
			fail("serve", err)
		}
		return
	}
	if len(os.Args) < 2 || os.Args[1] != "init" {
		fmt.Fprintln(os.Stderr, "cage-agent: runs inside a sandbox; cage starts it (usage: cage-agent init | serve)")
		os.Exit(2)
	}
	trace.Mark("agent main")
	sb, err := child.Init()
	if err != nil {
		fail("sandbox setup", err)
	}
	cfg := sb.Config
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// The agent is built while the root is: neither needs the other.
	var srv *agent.Server
	built := make(chan error, 1)
	go func() {
		var err error
		srv, err = agent.New(cfg)
		built <- err
	}()
	if err := sb.Build(); err != nil {
		fail("sandbox setup", err)
	}
	if err := <-built; err != nil {
		fail("sandbox setup", err)
	}
	// Built: sealed now, its threads taken, then it waits for the request
	// (at once, unless kept in a pool), which needs no privilege.
	if err := sb.Seal(); err != nil {
		fail("sandbox setup", err)
	}
	srv.ReserveThreads()
	// One P from now on: the agent serves a request at a time, and with a
	// second one Go's scheduler keeps waking threads that find nothing to
	// do (measured per command: 47 context switches -> 27, a quarter less
	// of the agent's CPU). The sandbox's processes are not its threads,
	// and a blocked system call still hands the P on. The process wall
	// starts the agent with GOMAXPROCS=1 already (then this costs nothing);
	// this is for an agent started without it.
	runtime.GOMAXPROCS(1)
	if !sb.StartPending() {
		// Kept in a pool: its first request's one-time costs are paid now.
		if err := srv.WarmUp(); err != nil {
			fmt.Fprintln(os.Stderr, "cage-agent:", err)
		}
		trace.Mark("warmed up")
	}
	token, env, maxOutput, err := sb.WaitStart()
	if err != nil {
		fail("sandbox setup", err)
	}
	srv.Configure(token, env, maxOutput)
	if run := sb.OneShot(); run != nil {
		// Made for one command (cage run): its end is the sandbox's, and
		// the kernel ends whatever else runs in it as this PID 1 exits.
		if err := srv.RunOnce(*run); err != nil {
			fail("one-shot run", err)
		}
		return
	}
	if err := srv.Serve(sb.Listener); err != nil {
		fail("serve", err)
	}
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "cage-agent: %s: %v\n", what, err)
	os.Exit(1)
}
