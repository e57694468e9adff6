package microvm

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/template"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/vm"
)

// needVM skips unless this host can boot a guest: root, QEMU, mke2fs and
// the guest kernel (scripts/kernel.sh).
func needVM(t testing.TB) *vm.Kernel {
	t.Helper()
	testutil.RequireRoot(t)
	for _, tool := range []string{vm.QEMU, "mke2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("SKIP: %s is not installed (scripts/kernel.sh installs QEMU)", tool)
		}
	}
	dir := os.Getenv("CAGE_KERNEL_DIR")
	if dir == "" {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			t.Skip("SKIP: no module root")
		}
		dir = filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), ".tools", "kernel")
	}
	k, err := vm.FindKernel(dir)
	if err != nil {
		t.Skipf("SKIP: no guest kernel: %v", err)
	}
	return k
}

// TestGuestAgent: a VM booted (TCG) from an image template serves the
// agent's protocol: commands run in the image's files as the sandbox's
// user, writes land in the VM's own layer, and Destroy leaves nothing.
func TestGuestAgent(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	store, err := imgstore.Open(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	path := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")
	if _, err := store.Import(context.Background(), path, "cage-test", imgstore.Options{}); err != nil {
		t.Fatal(err)
	}
	tmpl, err := template.Lookup("cage-test", t.TempDir(), store)
	if err != nil {
		t.Fatal(err)
	}
	runDir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	sb, err := Create(ctx, Config{ID: "0123456789abcdef0123", RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"),
		Kernel: k, Template: tmpl, MemoryMB: 256, CPUs: 1, DiskBytes: 16 << 20, Token: "secret", Threads: 20})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	c := agentclient.New(sb.Dial, sb.Token())
	var out bytes.Buffer
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", "head -1 /etc/os-release; id -u; cat /etc/hostname; echo x > /home/user/f && cat /home/user/f"}, Stdout: &out, Stderr: &out})
	t.Logf("cold boot -> command done: %v", time.Since(start).Round(time.Millisecond))
	if err != nil || end.GetExitCode() != 0 || out.String() != "ID=cage-test\n1000\ncage-01234567\nx\n" {
		t.Errorf("in the guest: %q, %v, %v", out.String(), end, err)
	}
	// The wrong token is refused.
	bad := agentclient.New(sb.Dial, "wrong")
	if _, err := bad.Run(ctx, agentclient.RunOptions{Cmd: "true"}); err == nil {
		t.Error("a command with the wrong token ran")
	}
	c.Close()
	bad.Close()
	if err := sb.Destroy(); err != nil {
		t.Errorf("destroy: %v", err)
	}
	select {
	case <-sb.Exited():
	case <-time.After(10 * time.Second):
		t.Error("QEMU still runs after Destroy")
	}
	if _, err := os.Stat(filepath.Join(runDir, "sandboxes", "0123456789abcdef0123")); !os.IsNotExist(err) {
		t.Errorf("the sandbox's directory is left: %v", err)
	}
}

// BenchmarkColdBoot: create (cold boot under TCG) -> first byte of `echo`
// from the guest's agent; destroying is not timed.
func BenchmarkColdBoot(b *testing.B) {
	k := needVM(b)
	bin := testutil.Binaries(b)
	store, err := imgstore.Open(filepath.Join(b.TempDir(), "templates"))
	if err != nil {
		b.Fatal(err)
	}
	path := testutil.WriteDockerArchive(b, testutil.TestImage(b), "cage-test:latest")
	if _, err := store.Import(context.Background(), path, "cage-test", imgstore.Options{}); err != nil {
		b.Fatal(err)
	}
	tmpl, err := template.Lookup("cage-test", b.TempDir(), store)
	if err != nil {
		b.Fatal(err)
	}
	runDir := b.TempDir()
	var samples []time.Duration
	for i := 0; i < b.N; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		start := time.Now()
		sb, err := Create(ctx, Config{ID: fmt.Sprintf("bench%015d", i), RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"),
			Kernel: k, Template: tmpl, DiskBytes: 16 << 20, Token: "t", Threads: 20})
		if err != nil {
			b.Fatal(err)
		}
		c := agentclient.New(sb.Dial, sb.Token())
		fw := &firstByte{}
		if _, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"x"}, Stdout: fw}); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, fw.at.Sub(start))
		b.StopTimer()
		c.Close()
		_ = sb.Destroy()
		cancel()
		b.StartTimer()
	}
	slices.Sort(samples)
	pct := func(p float64) time.Duration { return samples[min(len(samples)-1, int(p*float64(len(samples))))] }
	for _, m := range []struct {
		name string
		p    float64
	}{{"p50-ms", 0.5}, {"p95-ms", 0.95}, {"p99-ms", 0.99}} {
		b.ReportMetric(float64(pct(m.p).Microseconds())/1000, m.name)
	}
}

type firstByte struct{ at time.Time }

func (f *firstByte) Write(p []byte) (int, error) {
	if f.at.IsZero() {
		f.at = time.Now()
	}
	return len(p), nil
}
