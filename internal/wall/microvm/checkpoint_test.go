package microvm

import (
	"bytes"
	"context"
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
		t.Logf("cycle %d: checkpoint %v, %d MiB", cycle, time.Since(start).Round(time.Millisecond), fi.Size()>>20)
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
		if err := sb.Restore(ctx, dir); err != nil {
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
	if err := sb.Restore(ctx, dir); err == nil {
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
