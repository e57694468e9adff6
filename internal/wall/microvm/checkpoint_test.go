package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
)

// TestCheckpointRestore: a checkpointed microvm holds nothing on the host
// (QEMU has ended, its directory is gone) yet is not gone; restored, its
// counting process counts on from where it stood, its files are there, its
// clock is the host's (it was saved seconds earlier) and its agent still
// takes only its token; a second cycle works as the first. A truncated
// state file is refused by the restore, which leaves nothing running.
func TestCheckpointRestore(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "cccccccc00000000000003", Template: tmpl, DiskBytes: 16 << 20, Token: "secret"},
		RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	defer func() {
		if err := sb.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
	}()
	run := func(script string) string {
		t.Helper()
		c := agentclient.New(sb.Dial, sb.Token())
		defer c.Close()
		var out bytes.Buffer
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &out})
		if err != nil || end.GetExitCode() != 0 {
			t.Fatalf("%q: %v %v %q", script, err, end, out.String())
		}
		return out.String()
	}
	// Its snapshot was made (its RAM file written) and it runs under the
	// bound of QEMU's files, which its checkpoints below must fit.
	want := strconv.FormatInt(vm.FileBound(256), 10)
	if soft, hard := qemuFileLimit(t, sb.v.Pid()); soft != want || hard != want {
		t.Errorf("QEMU's file size limit is %s (hard %s), not vm.FileBound's %s", soft, hard, want)
	}
	count := func() int {
		t.Helper()
		n, err := strconv.Atoi(strings.TrimSpace(run("cat /tmp/count")))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	run(`sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.2; done' </dev/null >/dev/null 2>&1 &
echo kept > /home/user/kept
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do [ -s /tmp/count ] && exit 0; sleep 0.5; done; exit 1`)
	for cycle := 1; cycle <= 2; cycle++ {
		before := count()
		dir := filepath.Join(t.TempDir(), "ckpt")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := sb.Checkpoint(ctx, dir); err != nil {
			t.Fatalf("cycle %d: checkpoint: %v", cycle, err)
		}
		fi, _ := os.Stat(filepath.Join(dir, checkpointState))
		t.Logf("cycle %d: checkpoint %v, %d MiB (its bound %d MiB)", cycle, time.Since(start).Round(time.Millisecond), fi.Size()>>20, vm.FileBound(256)>>20)
		select {
		case <-sb.v.Exited():
		default:
			t.Errorf("cycle %d: QEMU runs on after the checkpoint", cycle)
		}
		if _, err := os.Stat(sb.dir); err == nil {
			t.Errorf("cycle %d: the sandbox's directory is left on the host", cycle)
		}
		select {
		case <-sb.Exited():
			t.Fatalf("cycle %d: a checkpointed sandbox reads as gone", cycle)
		case <-time.After(2 * time.Second): // and the guest's clock falls behind meanwhile
		}
		start = time.Now()
		if err := sb.Restore(ctx, dir, nil); err != nil {
			t.Fatalf("cycle %d: restore: %v", cycle, err)
		}
		t.Logf("cycle %d: restore %v", cycle, time.Since(start).Round(time.Millisecond))
		after := count()
		time.Sleep(time.Second)
		later := count()
		if after < before || after > before+10 || later <= after {
			t.Errorf("cycle %d: the counter read %d before, %d after the restore, %d a second later", cycle, before, after, later)
		}
		if got := run("cat /home/user/kept"); got != "kept\n" {
			t.Errorf("cycle %d: a file after the restore: %q", cycle, got)
		}
		var guest int64
		fmt.Sscan(run("busybox date +%s"), &guest)
		if d := guest - time.Now().Unix(); d < -2 || d > 2 {
			t.Errorf("cycle %d: the guest's clock is %ds off the host's", cycle, d)
		}
		bad := agentclient.New(sb.Dial, "wrong")
		if _, err := bad.Run(ctx, agentclient.RunOptions{Cmd: "true"}); err == nil {
			t.Errorf("cycle %d: a wrong token ran a command", cycle)
		}
		bad.Close()
	}
	// No room for the state: the checkpoint fails, the sandbox runs on.
	full := filepath.Join(t.TempDir(), "full")
	if err := os.Mkdir(full, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", full, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(full, unix.MNT_DETACH)
	before := count()
	if err := sb.Checkpoint(ctx, full); err == nil {
		t.Fatal("a checkpoint into 1 MiB succeeded")
	} else {
		t.Logf("a checkpoint into 1 MiB: %v", err)
	}
	time.Sleep(time.Second)
	if after := count(); after <= before {
		t.Errorf("the counter stopped after a failed checkpoint: %d then %d", before, after)
	}
	// A truncated state: the restore fails and leaves nothing running.
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sb.Checkpoint(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(dir, checkpointState), 4096); err != nil {
		t.Fatal(err)
	}
	if err := sb.Restore(ctx, dir, nil); err == nil {
		t.Fatal("restore from a truncated state succeeded")
	} else {
		t.Logf("restore from a truncated state: %v", err)
	}
	select {
	case <-sb.v.Exited():
	default:
		t.Error("QEMU runs on after a failed restore")
	}
	if _, err := os.Stat(sb.dir); err == nil {
		t.Error("a failed restore left the sandbox's directory")
	}
}

// qemuFileLimit is the soft and hard RLIMIT_FSIZE of process pid.
func qemuFileLimit(t *testing.T, pid int) (soft, hard string) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(strings.TrimPrefix(l, "Max file size")); strings.HasPrefix(l, "Max file size") && len(f) >= 2 {
			return f[0], f[1]
		}
	}
	t.Fatalf("no file size limit in /proc/%d/limits", pid)
	return "", ""
}

// sigIgnored reports whether process pid ignores sig.
func sigIgnored(t *testing.T, pid int, sig unix.Signal) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if hexMask, ok := strings.CutPrefix(l, "SigIgn:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(hexMask), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return mask&(1<<(uint(sig)-1)) != 0
		}
	}
	t.Fatalf("no SigIgn in /proc/%d/status", pid)
	return false
}

// TestCheckpointBounded: QEMU's jail bounds the files it writes
// (RLIMIT_FSIZE), so a checkpoint is at most its bound on the host's disk.
// Hostile case: a QEMU that writes more state than its bound, played by
// an honest QEMU given a bound of 8 MiB, less than its guest's memory in
// use. Expected: the checkpoint fails with one line saying the bound was
// reached (vm.ErrFileBound), leaves no state behind, and the sandbox runs
// on (QEMU ignores SIGXFSZ: its write fails, it does not die). Before, a
// compromised QEMU could fill the host's disk through the descriptor
// (found by review, 2026-12-03).
func TestCheckpointBounded(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const bound = 8 << 20
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "cccccccc00000000000004", Template: tmpl, DiskBytes: 16 << 20, Token: "secret"},
		RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1, coldBoot: true, fileBytes: bound})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	defer func() {
		if err := sb.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
	}()
	if soft, hard := qemuFileLimit(t, sb.v.Pid()); soft != "8388608" || hard != "8388608" {
		t.Errorf("QEMU's file size limit is %s (hard %s), not its bound", soft, hard)
	}
	// Whichever of its threads writes (its migration thread blocks every
	// signal, its main thread does not), it is not killed.
	if !sigIgnored(t, sb.v.Pid(), unix.SIGXFSZ) {
		t.Error("QEMU does not ignore SIGXFSZ: a write past its bound would end it")
	}
	run := func(script string) string {
		t.Helper()
		c := agentclient.New(sb.Dial, sb.Token())
		defer c.Close()
		var out bytes.Buffer
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &out})
		if err != nil || end.GetExitCode() != 0 {
			t.Fatalf("%q: %v %v %q", script, err, end, out.String())
		}
		return out.String()
	}
	run("echo kept > /home/user/kept")
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	err = sb.Checkpoint(ctx, dir)
	if err == nil {
		t.Fatal("a checkpoint past its bound succeeded")
	}
	t.Logf("a checkpoint past its bound: %v", err)
	if !errors.Is(err, vm.ErrFileBound) || strings.Contains(err.Error(), "\n") {
		t.Errorf("the error is not one line saying the bound was reached: %q", err)
	}
	if errors.Is(err, wall.ErrStopped) {
		t.Errorf("the failed checkpoint stopped the sandbox: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("the failed checkpoint left %d files in its directory", len(ents))
	}
	select {
	case <-sb.v.Exited():
		t.Fatalf("QEMU ended at its bound: %v", sb.v.Wait())
	case <-sb.Exited():
		t.Fatal("the sandbox ended at its checkpoint's bound")
	default:
	}
	if got := run("cat /home/user/kept; echo on"); got != "kept\non\n" {
		t.Errorf("after the failed checkpoint the sandbox says %q", got)
	}
}

// TestRestoreStartedBeforeItsGuest: a restore's wait for the guest's agent
// is the sandbox's (a guest of the sandbox's making answers when it
// chooses, or never): Restore calls started once QEMU runs the guest
// again, before that wait, so its caller lets go of the host's create
// slot there. Here the guest is stopped (QEMU, SIGSTOP) as started is
// called: the restore still waits, and it ends with its context, leaving
// nothing running. (Before, the daemon held a create slot, which every
// tenant's creates wait for, until the guest answered or checkpointOps'
// five minutes ran out.)
func TestRestoreStartedBeforeItsGuest(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "cccccccc00000000000009", Template: tmpl, DiskBytes: 16 << 20, Token: "secret"},
		RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	defer func() {
		if err := sb.Destroy(); err != nil {
			t.Errorf("destroy: %v", err)
		}
	}()
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sb.Checkpoint(ctx, dir); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	started := make(chan struct{})
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	done := make(chan error, 1)
	go func() {
		done <- sb.Restore(rctx, dir, func() {
			_ = unix.Kill(sb.v.Pid(), unix.SIGSTOP)
			close(started)
		})
	}()
	select {
	case <-started:
	case err := <-done:
		t.Fatalf("the restore ended (%v) before it said the guest was started", err)
	case <-time.After(2 * time.Minute):
		t.Fatal("no start after two minutes")
	}
	select {
	case err := <-done:
		t.Fatalf("the restore ended (%v) though its guest was stopped", err)
	case <-time.After(2 * time.Second):
	}
	rcancel()
	select {
	case err := <-done:
		t.Logf("a restore whose guest never answered: %v", err)
		if err == nil {
			t.Error("a restore whose guest never answered succeeded")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the restore did not end with its context")
	}
	select {
	case <-sb.v.Exited():
	case <-time.After(10 * time.Second):
		t.Error("QEMU runs on after a failed restore")
	}
}
