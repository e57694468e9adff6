package oci_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/oci"
)

// counterScript starts a process that counts in /tmp/count, five a second;
// it renames each count into place, so a reader never finds the file empty.
const counterScript = `nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.2; done' >/dev/null 2>&1 &
echo kept > /home/user/kept; sleep 1`

// sh runs a shell command in sb and returns its output.
func sh(t *testing.T, sb wall.Sandbox, script string) string {
	t.Helper()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out strings.Builder
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out})
	if err != nil || end.GetExitCode() != 0 {
		t.Fatalf("%q: %v %v %q", script, err, end, out.String())
	}
	return out.String()
}

func count(t *testing.T, sb wall.Sandbox) int {
	t.Helper()
	n, err := strconv.Atoi(strings.TrimSpace(sh(t, sb, "cat /tmp/count")))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCheckpointRestore: a gVisor sandbox checkpointed holds no process
// (its cgroup is empty, yet it is not gone), and restored it goes on: the
// counting process counts on from where it stood, the files are there,
// the agent answers; a second cycle works as the first. A damaged image
// is refused by the restore, which leaves the sandbox stopped, and the
// sandbox is destroyed cleanly.
func TestCheckpointRestore(t *testing.T) {
	testutil.RequireRoot(t)
	h := newHost(t, testutil.RunDir(t))
	if err := h.WallMissing("gvisor"); err != nil {
		testutil.SkipWall(t, "gvisor", "%v", err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Wall: "gvisor"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := sb.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
		if n := len(sb.Cgroup().Procs()); n != 0 {
			t.Errorf("%d processes left after destroy", n)
		}
	}()
	cp, ok := sb.(wall.Checkpointable)
	if !ok {
		t.Fatal("a gVisor sandbox is not Checkpointable")
	}
	sh(t, sb, counterScript)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for cycle := 1; cycle <= 2; cycle++ {
		before := count(t, sb)
		dir := filepath.Join(t.TempDir(), "ckpt")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := cp.Checkpoint(ctx, dir); err != nil {
			t.Fatalf("cycle %d: checkpoint: %v", cycle, err)
		}
		if n := len(sb.Cgroup().Procs()); n != 0 {
			t.Errorf("cycle %d: %d processes in the cgroup of a checkpointed sandbox", cycle, n)
		}
		select {
		case <-sb.Exited():
			t.Fatalf("cycle %d: a checkpointed sandbox reads as gone", cycle)
		case <-time.After(300 * time.Millisecond):
		}
		if err := cp.Restore(ctx, dir, nil); err != nil {
			t.Fatalf("cycle %d: restore: %v", cycle, err)
		}
		after := count(t, sb)
		time.Sleep(time.Second)
		later := count(t, sb)
		if after < before || after > before+5 || later <= after {
			t.Errorf("cycle %d: the counter read %d before, %d after the restore, %d a second later", cycle, before, after, later)
		}
		if got := sh(t, sb, "cat /home/user/kept"); got != "kept\n" {
			t.Errorf("cycle %d: a file after the restore: %q", cycle, got)
		}
	}
	// A damaged image: the restore fails, the sandbox stays stopped.
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := cp.Checkpoint(ctx, dir); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if err := os.Truncate(filepath.Join(dir, e.Name()), 100); err != nil {
			t.Fatal(err)
		}
	}
	if err := cp.Restore(ctx, dir, nil); err == nil {
		t.Fatal("restore from a truncated image succeeded")
	} else {
		t.Logf("restore from a truncated image: %v", err)
	}
	if n := len(sb.Cgroup().Procs()); n != 0 {
		t.Errorf("%d processes left by a failed restore", n)
	}
}

// TestCheckpointDiskFull: a checkpoint with no room for its image fails,
// and runsc's save takes the sandbox with it: Checkpoint says so
// (wall.ErrStopped), and destroyed nothing of it is left. (The daemon checks for room
// first, and pauses such a sandbox with its files, saved before.)
func TestCheckpointDiskFull(t *testing.T) {
	testutil.RequireRoot(t)
	h := newHost(t, testutil.RunDir(t))
	if err := h.WallMissing("gvisor"); err != nil {
		testutil.SkipWall(t, "gvisor", "%v", err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Wall: "gvisor"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Destroy()
	cp := sb.(wall.Checkpointable)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sh(t, sb, counterScript)
	// No room for the image: the checkpoint fails, and runsc's save takes
	// the sandbox with it (wall.ErrStopped; the daemon checks for room
	// first, and resumes such a sandbox from its files).
	full := filepath.Join(t.TempDir(), "full")
	if err := os.Mkdir(full, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", full, "tmpfs", 0, "size=256k"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(full, unix.MNT_DETACH)
	if err := cp.Checkpoint(ctx, full); !errors.Is(err, wall.ErrStopped) {
		t.Fatalf("a checkpoint into 256 KiB: %v, want ErrStopped", err)
	}
	if err := sb.Destroy(); err != nil {
		t.Errorf("destroy: %v", err)
	}
	if n := len(sb.Cgroup().Procs()); n != 0 {
		t.Errorf("%d processes left after a failed checkpoint and destroy", n)
	}
}

// TestRestoreStartedBeforeItsAgent: a restore's wait for its agent is the
// sandbox's (a compromised agent comes back when it chooses, or never):
// Restore calls started once runsc runs the sandbox again, before that
// wait, so its caller lets go of the host's create slot there. Here the
// agent was stopped before the checkpoint: started is called while the
// restore still waits, and the restore ends with its context. (Before,
// the daemon held a create slot, which every tenant's creates wait for,
// until the agent came back or checkpointOps' five minutes ran out.)
func TestRestoreStartedBeforeItsAgent(t *testing.T) {
	testutil.RequireRoot(t)
	h := newHost(t, testutil.RunDir(t))
	if err := h.WallMissing("gvisor"); err != nil {
		testutil.SkipWall(t, "gvisor", "%v", err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Wall: "gvisor"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := sb.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
	}()
	cp := sb.(wall.Checkpointable)
	sh(t, sb, "true") // its agent serves
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := oci.StopAgent(ctx, sb); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := cp.Checkpoint(ctx, dir); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	started := make(chan struct{})
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	done := make(chan error, 1)
	go func() { done <- cp.Restore(rctx, dir, func() { close(started) }) }()
	start := time.Now()
	select {
	case <-started:
		t.Logf("started after %v", time.Since(start))
	case err := <-done:
		t.Fatalf("the restore ended (%v) before it said the sandbox was started", err)
	case <-time.After(time.Minute):
		t.Fatal("no start after a minute")
	}
	select {
	case err := <-done:
		t.Fatalf("the restore ended (%v) though its agent was stopped", err)
	case <-time.After(2 * time.Second):
	}
	rcancel()
	start = time.Now()
	select {
	case err := <-done:
		t.Logf("the restore ended %v after its context: %v", time.Since(start), err)
		if err == nil {
			t.Error("a restore whose agent never came back succeeded")
		}
	case <-time.After(30 * time.Second):
		t.Error("the restore did not end with its context")
	}
}
