package microvm

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/vm"
	"github.com/cagehq/cage/internal/wall"
)

// qemuNices is the nice value of every thread of QEMU (pid).
func qemuNices(t *testing.T, pid int) map[int]int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		t.Fatal(err)
	}
	nices := map[int]int{}
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
		if err != nil {
			continue // ended meanwhile
		}
		nices[tid] = 20 - p
	}
	if len(nices) == 0 {
		t.Fatalf("QEMU (pid %d) has no threads", pid)
	}
	return nices
}

// TestPrepareBackground: a pool's VM (prepared in the background) is
// restored with QEMU's every thread at vm.BackgroundNice, so that a pool
// refilling takes little CPU from the creates it serves; Foreground (its
// take) puts every thread back to 0, and the VM then serves its request.
// A VM created for a request runs at the normal priority throughout.
func TestPrepareBackground(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := func(id string) Config {
		return Config{Spec: wall.Spec{ID: id, Template: tmpl, DiskBytes: 16 << 20, Token: "token-" + id}, RunDir: runDir,
			AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1}
	}
	// The first create makes the snapshot; this one is a request's.
	plain, err := Create(ctx, cfg("cccccccc00000000000001"))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Destroy()
	for tid, n := range qemuNices(t, plain.v.Pid()) {
		if n != 0 {
			t.Errorf("a request's VM: QEMU thread %d runs at nice %d, want 0", tid, n)
		}
	}

	c := cfg("dddddddd00000000000002")
	c.prepare, c.background = true, true
	sb, err := Create(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Destroy()
	if !sb.restored {
		t.Fatal("the prepared VM was booted cold, not restored")
	}
	for tid, n := range qemuNices(t, sb.v.Pid()) {
		if n != vm.BackgroundNice {
			t.Errorf("a pool's VM: QEMU thread %d runs at nice %d, want %d", tid, n, vm.BackgroundNice)
		}
	}
	sb.Foreground()
	for tid, n := range qemuNices(t, sb.v.Pid()) {
		if n != 0 {
			t.Errorf("a taken VM: QEMU thread %d runs at nice %d, want 0", tid, n)
		}
	}
	if err := sb.Start(c.Spec); err != nil {
		t.Fatal(err)
	}
	ac := agentclient.New(sb.Dial, sb.Token())
	defer ac.Close()
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "true"})
	if err != nil {
		t.Fatalf("the taken VM's command: %v", err)
	}
	if end.GetExitCode() != 0 {
		t.Fatalf("the taken VM's command exited %d", end.GetExitCode())
	}
}
