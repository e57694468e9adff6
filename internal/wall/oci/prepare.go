package oci

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/inside"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/oci/container"
	"github.com/cagehq/cage/internal/wall/state"
)

// A prepared sandbox (a pool's, wall.Preparer) is a container made and
// started as Create makes one, with its pool's id, hostname, template and
// sizes, whose agent has read the first document of its spec, connected
// its channel or taken its listener, and waits for the second: the
// request's token, environment and output bound. Until then nothing but
// the agent runs in it, and no one holds its token (it has none). Start
// applies the request's limits and network policy, then sends the second
// document; the agent seals itself and serves as after a Create.
//
// What the runtime fixed as it started the container stays: whether it
// has a network interface (gVisor's netstack takes it over at its start,
// and the image's resolv.conf is written then), and /dev/shm's size. Fits
// says so. The disk is resized by Start (its tmpfs is the host's).

// preparation is what a prepared sandbox was made from, to tell whether
// a request fits it and whether it is stale.
type preparation struct {
	template, imageID, etc string
	agent, runtime         string // the agent's and runtime's identities (state.FileID)
	agentPath, runtimePath string
	networked              bool
	disk, shm              int64
	niced                  bool           // made at backgroundNice
	limits                 cgroups.Limits // written as it was made
	started                bool
}

func newPreparation(cfg job, networked bool) (*preparation, error) {
	p := &preparation{template: cfg.Template.Name, etc: cfg.Template.EtcCache, networked: networked, niced: cfg.background && !cfg.Runtime.gvisor(),
		disk: cfg.DiskBytes, shm: cfg.ShmBytes, limits: cfg.Limits, agentPath: cfg.AgentPath, runtimePath: cfg.Runtime.Binary}
	if cfg.Template.Image != nil {
		p.imageID = cfg.Template.Image.Info.ID
	}
	var err error
	if p.agent, err = state.FileID(cfg.AgentPath); err != nil {
		return nil, err
	}
	if p.runtime, err = state.FileID(cfg.Runtime.Binary); err != nil {
		return nil, err
	}
	return p, nil
}

// Prepare makes a sandbox of spec (id, hostname, template, sizes, limits,
// and a network under spec.NetPolicy when spec.Net is set) whose agent
// waits for Start.
func (d *Driver) Prepare(ctx context.Context, spec wall.Spec, background bool) (wall.Prepared, error) {
	if err := d.Missing(); err != nil {
		return nil, err
	}
	if spec.DieWithCaller || len(spec.Volumes) > 0 {
		return nil, fmt.Errorf("%w: a prepared sandbox has no caller to die with and no volumes", wall.ErrInvalid)
	}
	return create(ctx, job{Config: d.cfg, Spec: spec, prepare: true, background: background})
}

// backgroundNice is the priority a pool's runc sandboxes are made at,
// runtime and container alike (as the process wall's), until Start. A
// gVisor one is made at the normal priority (see create: systrap would
// keep the tenant's threads niced).
const backgroundNice = 15

// runAt runs cmd with it and its descendants at nice (0: as this
// process): it is started from a thread of its own at that priority, which
// it inherits (see onOwnThread). setup, when not nil, runs first on that
// thread, in a mount namespace the thread unshares for itself (a copy of
// this process's, whose mounts propagate to no other: slave), which cmd
// inherits: what setup mounts there is cmd's and its children's alone,
// and goes when they leave it (see layers.go).
func runAt(cmd *exec.Cmd, nice int, setup func() error) error {
	if nice == 0 && setup == nil {
		return cmd.Run()
	}
	var err error
	onOwnThread(func() { err = startAt(cmd, nice, setup) })
	if err != nil {
		return err
	}
	return cmd.Wait()
}

func startAt(cmd *exec.Cmd, nice int, setup func() error) error {
	if nice != 0 {
		if err := unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), nice); err != nil {
			return err
		}
	}
	if setup != nil {
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("a mount namespace for %s: %w", filepath.Base(cmd.Path), err)
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
			return fmt.Errorf("a mount namespace for %s: %w", filepath.Base(cmd.Path), err)
		}
		if err := setup(); err != nil {
			return err
		}
	}
	return cmd.Start()
}

// onOwnThread runs fn on a thread of its own, which ends when fn returns:
// fn may change the thread for good (its priority, its namespaces). Never
// on the process's main thread, which Go keeps when a goroutine locked to
// it ends, and whose state /proc/<pid> shows (its mountinfo): a goroutine
// that finds itself there holds it while another runs fn (a thread held so
// runs no other goroutine), then lets it go untouched.
func onOwnThread(fn func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			defer runtime.UnlockOSThread()
			onOwnThread(fn)
			return
		}
		fn() // not unlocked: the thread ends with this goroutine
	}()
	<-done
}

// renice takes backgroundNice off every thread of every process in the
// sandbox's cgroup (the agent under runc): nice is per thread in Linux, and
// each inherited the background value. A thread a niced one makes while
// the list is walked inherits the background value too, so the walk is
// repeated until it finds none left (a few times at most).
func (sb *Sandbox) renice() {
	for pass := 0; pass < 8 && sb.reniceOnce() > 0; pass++ {
	}
}

// reniceOnce renices the threads still at the background priority and
// says how many it found.
func (sb *Sandbox) reniceOnce() int {
	found := 0
	for _, pid := range sb.cg.Procs() {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if n, ok := threadNice(pid, tid); ok && n >= backgroundNice {
				found++
				_ = unix.Setpriority(unix.PRIO_PROCESS, tid, max(0, n-backgroundNice))
			}
		}
	}
	return found
}

// threadNice is a thread's nice value, from /proc (ok false when it is
// gone).
func threadNice(pid, tid int) (int, bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
	if err != nil {
		return 0, false
	}
	// The fields after the command's closing parenthesis; nice is the
	// 19th field of the line.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) <= 16 {
		return 0, false
	}
	n, err := strconv.Atoi(f[16])
	return n, err == nil
}

// PreparesNetwork is true: the network interface is made as the runtime
// starts (see wall.NetPreparer).
func (d *Driver) PreparesNetwork() bool { return true }

// Stale says whether the sandbox was prepared from other files than t's
// now, or with another agent or runtime binary than the host has now.
func (sb *Sandbox) Stale(t *template.Template) bool {
	p := sb.prep
	if p == nil {
		return false
	}
	if t == nil || t.Name != p.template || t.EtcCache != p.etc || (t.Image == nil) != (p.imageID == "") ||
		(t.Image != nil && t.Image.Info.ID != p.imageID) {
		return true
	}
	agent, err := state.FileID(p.agentPath)
	if err != nil || agent != p.agent {
		return true
	}
	rt, err := state.FileID(p.runtimePath)
	return err != nil || rt != p.runtime
}

// Fits says whether a create of spec can be given this prepared sandbox:
// the same network interface (or none) and /dev/shm size, no volumes, not
// tied to its caller.
func (sb *Sandbox) Fits(spec wall.Spec) bool {
	p := sb.prep
	if p == nil || p.started {
		return false
	}
	networked := spec.Net != nil && spec.NetPolicy.Networked()
	return networked == p.networked && spec.ShmBytes == p.shm && len(spec.Volumes) == 0 && !spec.DieWithCaller
}

// Start gives the prepared sandbox its request: the token, limits, disk
// size and network policy, then the agent's environment and output bound;
// the agent then seals itself and serves. wall.ErrStale when the sandbox
// was prepared from what is no longer current (the caller makes another).
func (sb *Sandbox) Start(spec wall.Spec) error {
	p := sb.prep
	if p == nil || p.started || sb.specW == nil {
		return errors.New("sandbox already started")
	}
	if sb.Stale(spec.Template) {
		return wall.ErrStale
	}
	if !sb.Fits(spec) {
		return fmt.Errorf("%w: the prepared sandbox does not fit the request", wall.ErrInvalid)
	}
	p.started = true
	sb.token = spec.Token
	if p.niced {
		sb.renice()
	}
	if spec.Limits != p.limits {
		if err := sb.cg.Apply(spec.Limits); err != nil {
			return err
		}
	}
	if spec.DiskBytes > 0 && spec.DiskBytes != p.disk && sb.diskMount != "" {
		if err := template.ResizeImageDisk(sb.dir, spec.DiskBytes, inside.InodesFor(spec.DiskBytes)); err != nil {
			return err
		}
	}
	if sb.net != nil {
		if err := sb.net.SetFirstPolicy(spec.NetPolicy); err != nil {
			return err
		}
	}
	err := writeStart(sb.specW, spec)
	sb.specW = nil
	return err
}

// writeStart sends the agent the request's part of its spec and closes w.
func writeStart(w *os.File, spec wall.Spec) error {
	data, err := json.Marshal(container.Start{Token: spec.Token, Env: spec.Env, MaxOutput: spec.MaxOutput})
	if err == nil {
		_, err = w.Write(append(data, '\n'))
	}
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("send the sandbox its spec: %w", err)
	}
	return nil
}
