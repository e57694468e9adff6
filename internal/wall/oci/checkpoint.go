package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/state"
)

// Checkpoints (gVisor only): runsc checkpoint saves the sandbox's kernel,
// its processes and their memory into a directory and stops the sandbox;
// runsc restore starts it again from there, with the same bundle, mounts,
// cgroup and network namespace, all of which the sandbox keeps meanwhile
// (its state directory, its disk, its network, its slot): only its
// processes and their memory are gone. The agent connects to the host's
// channel again by itself, as after a daemon's restart.
//
// runsc restore hands the restored container its standard streams and no
// other descriptor it was passed at start; so a gVisor agent's cgroup
// counters are its standard input and output (see run), and the lock on
// its slot, the one other descriptor it holds, it lets go before the
// checkpoint (SIGUSR2; the daemon holds the slot from then on, and a
// daemon that adopts the sandbox later takes it again).
//
// The host never reads the image: it is runsc's, written from the
// sandbox's memory, and only runsc restore reads it, into the same
// sandbox.

// lockRelease bounds the wait for the agent to let go of its lock.
const lockRelease = 5 * time.Second

// Checkpoint saves the running sandbox into dir and stops it.
func (sb *Sandbox) Checkpoint(ctx context.Context, dir string) error {
	if !sb.rt.gvisor() {
		return fmt.Errorf("%w: the %s wall cannot checkpoint a sandbox", wall.ErrInvalid, sb.rt.Wall)
	}
	if sb.pidfd < 0 {
		return fmt.Errorf("sandbox %s is not running", sb.id)
	}
	if err := sb.releaseLock(ctx); err != nil {
		return err
	}
	sb.mu.Lock()
	sb.stopping = true
	sb.mu.Unlock()
	out, err := sb.runtime(ctx, "checkpoint", "--image-path", dir, sb.id)
	if err == nil {
		// runsc returns once the image is written; the sandbox exits then.
		select {
		case <-sb.procDone:
		case <-time.After(30 * time.Second):
			err = errors.New("the sandbox did not stop after its checkpoint")
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	if err != nil {
		select {
		case <-sb.procDone:
		case <-time.After(2 * time.Second): // a save failing midway takes the sandbox down within moments
		}
		select {
		case <-sb.procDone:
			// runsc's save failed midway and took the sandbox with it.
			return fmt.Errorf("checkpoint sandbox %s: %w: %v%s", sb.id, wall.ErrStopped, err, out)
		default:
		}
		sb.mu.Lock()
		sb.stopping = false
		sb.mu.Unlock()
		return fmt.Errorf("checkpoint sandbox %s: %v%s", sb.id, err, out)
	}
	sb.closePidfd()
	sb.pid = 0
	_, _ = sb.runtime(context.Background(), "delete", "--force", sb.id)
	return nil
}

// releaseLock has the agent let go of its lock on the slot (see above) and
// waits until the sandbox's kernel has closed it: a checkpoint that held it
// could not be restored.
func (sb *Sandbox) releaseLock(ctx context.Context) error {
	if !sb.holdsLock() {
		return nil
	}
	if _, err := sb.runtime(ctx, "kill", sb.id, "USR2"); err != nil {
		return fmt.Errorf("checkpoint sandbox %s: %w", sb.id, err)
	}
	deadline := time.Now().Add(lockRelease)
	for sb.holdsLock() {
		if time.Now().After(deadline) {
			return fmt.Errorf("checkpoint sandbox %s: its agent kept its lock", sb.id)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// holdsLock reports whether the sandbox's process holds a uid-range lock.
func (sb *Sandbox) holdsLock() bool {
	fds := filepath.Join("/proc", strconv.Itoa(sb.pid), "fd")
	ents, _ := os.ReadDir(fds)
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join(fds, e.Name())); err == nil && strings.HasPrefix(target, state.IDLockDir+"/") {
			return true
		}
	}
	return false
}

// Restore starts the checkpointed sandbox again from dir; started is
// called once runsc has it running, before the agent is waited for.
func (sb *Sandbox) Restore(ctx context.Context, dir string, started func()) error {
	if sb.pidfd >= 0 {
		return fmt.Errorf("sandbox %s is running", sb.id)
	}
	// A restore cut short (a crash) may have left the runtime's record.
	_, _ = sb.runtime(ctx, "delete", "--force", sb.id)
	if sb.net != nil {
		// runsc reads the interface's address and routes from the
		// namespace, where it took them off as the sandbox started.
		if err := sb.configureNetwork(); err != nil {
			return fmt.Errorf("restore sandbox %s: %w", sb.id, err)
		}
	}
	oom, err := os.Open(sb.cg.OOMEventsFile())
	if err != nil {
		return err
	}
	defer oom.Close()
	pids, err := os.Open(sb.cg.PidsEventsFile())
	if err != nil {
		return err
	}
	defer pids.Close()
	pidFile := filepath.Join(sb.dir, "pid")
	_ = os.Remove(pidFile)
	if err := runtimeRoot(sb.root); err != nil {
		return err
	}
	args := sb.rt.flags(sb.netns != "")
	args = append(args, "--root", sb.root, "restore", "--image-path", dir, "--bundle", filepath.Join(sb.dir, "bundle"),
		"--detach", "--pid-file", pidFile, sb.id)
	cmd := exec.CommandContext(ctx, sb.rt.Binary, args...)
	// A restore goes with the daemon that started it: the next one finds
	// the sandbox checkpointed, not half restored behind its back.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	errR, errW, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = oom, pids, errW
	sb.mu.Lock()
	sb.stderr = nil
	sb.mu.Unlock()
	go sb.drain(errR)
	err = cmd.Run()
	errW.Close()
	if err != nil {
		time.Sleep(50 * time.Millisecond)
		_, _ = sb.runtime(context.Background(), "delete", "--force", sb.id)
		return fmt.Errorf("restore sandbox %s: %v: %s", sb.id, err, sb.Err())
	}
	sb.mu.Lock()
	sb.stopping = false
	sb.mu.Unlock()
	if err := sb.started(pidFile); err != nil {
		return err
	}
	if started != nil {
		started()
	}
	// The agent connects to the channel again: wait for it.
	c, err := sb.Dial(ctx)
	if err != nil {
		return fmt.Errorf("restore sandbox %s: its agent: %w", sb.id, err)
	}
	c.Close()
	return nil
}

func (sb *Sandbox) configureNetwork() error {
	ns, err := os.Open(sb.netns)
	if err != nil {
		return err
	}
	defer ns.Close()
	return sb.net.ConfigureInside(int(ns.Fd()))
}

// runtime runs one of the runtime's commands on the sandbox and returns
// its output (prefixed with ": ") when it fails.
func (sb *Sandbox) runtime(ctx context.Context, args ...string) (string, error) {
	a := append(sb.rt.flags(sb.netns != ""), append([]string{"--root", sb.root}, args...)...)
	out, err := exec.CommandContext(ctx, sb.rt.Binary, a...).CombinedOutput()
	if err != nil {
		return ": " + lastLine(string(out)), err
	}
	return "", nil
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}

// CheckpointsMissing: gVisor checkpoints; runc would need CRIU, whose
// kernel check fails on the hosts cage runs on (runc sandboxes are frozen
// instead).
func (d *Driver) CheckpointsMissing() error {
	if err := d.Missing(); err != nil {
		return err
	}
	if d.name != "gvisor" {
		return fmt.Errorf("%w: the %s wall cannot checkpoint (CRIU); its sandboxes are frozen instead", wall.ErrInvalid, d.name)
	}
	return nil
}

// AdoptCheckpointed takes charge of a sandbox another process checkpointed:
// its state directory, cgroup and network are as it left them (unless the
// host restarted, which removed them).
func (d *Driver) AdoptCheckpointed(ctx context.Context, spec wall.Spec, slot int, dir string) (wall.Sandbox, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	if d.name != "gvisor" {
		return nil, fmt.Errorf("%w: the %s wall keeps no checkpoints", wall.ErrInvalid, d.name)
	}
	cfg := d.cfg
	sb := &Sandbox{id: spec.ID, token: spec.Token, rt: cfg.Runtime, exited: make(chan struct{}), pidfd: -1,
		dir: filepath.Join(cfg.RunDir, "sandboxes", spec.ID), root: filepath.Join(cfg.RunDir, cfg.Runtime.Wall),
		log: cfg.Log.With("sandbox", spec.ID, "wall", cfg.Runtime.Wall), stopping: true}
	sb.diskMount, sb.rootfs = filepath.Join(sb.dir, "disk"), filepath.Join(sb.dir, "rootfs")
	if !fileExists(filepath.Join(sb.dir, "bundle", "config.json")) {
		return nil, fmt.Errorf("sandbox %s: its state directory is gone (the host restarted?)", spec.ID)
	}
	var err error
	if sb.owner, err = state.LockOwner(sb.dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	fail := func(err error) (wall.Sandbox, error) {
		sb.owner.Close()
		sb.ids.Release()
		if sb.ch != nil {
			sb.ch.Close()
		}
		return nil, fmt.Errorf("sandbox %s: %w", spec.ID, err)
	}
	if slot >= 0 {
		if sb.ids, err = state.ReserveSlot(slot); err != nil {
			return fail(err)
		}
	}
	sb.cg = cfg.Cgroups.Open(spec.ID)
	if !fileExists(sb.cg.OOMEventsFile()) {
		return fail(errors.New("its cgroup is gone"))
	}
	// What a restore cut short by a crash left running.
	_, _ = sb.runtime(ctx, "delete", "--force", spec.ID)
	if err := killAll(sb.cg.Procs); err != nil {
		return fail(err)
	}
	if err := sb.adoptChannel(); err != nil {
		return fail(err)
	}
	if p := filepath.Join(sb.dir, "netns"); fileExists(p) {
		sb.netns = p
	}
	if spec.Net != nil && spec.NetPolicy.Networked() {
		if sb.netns == "" || slot < 0 {
			return fail(errors.New("its network is gone"))
		}
		if sb.net, err = spec.Net.Adopt(spec.ID, slot, spec.NetPolicy); err != nil {
			return fail(err)
		}
	}
	return sb, nil
}

// killAll kills the processes procs lists until it lists none.
func killAll(procs func() []int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		pids := procs()
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d processes of a restore cut short would not die", len(pids))
		}
		for _, pid := range pids {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
