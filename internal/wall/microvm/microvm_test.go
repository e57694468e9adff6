package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/wall"

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
			testutil.SkipWall(t, "microvm", "%s is not installed (scripts/kernel.sh installs QEMU)", tool)
		}
	}
	k, err := vm.FindKernel(testutil.KernelDir())
	if err != nil {
		testutil.SkipWall(t, "microvm", "no guest kernel: %v", err)
	}
	return k
}

// testTemplate imports the test image (testutil.TestImage) into a store
// of the test's own and resolves it.
func testTemplate(t testing.TB) *template.Template {
	t.Helper()
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
	return tmpl
}

// TestGuestAgent: a VM booted (TCG) from an image template serves the
// agent's protocol: commands run in the image's files as the sandbox's
// user, writes land in the VM's own layer, and Destroy leaves nothing.
// Booted cold, the path Create falls back on when there is no snapshot;
// TestRestore covers restores.
func TestGuestAgent(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "0123456789abcdef0123", Template: tmpl, DiskBytes: 16 << 20, Token: "secret"}, RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1, coldBoot: true})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	c := agentclient.New(sb.Dial, sb.Token())
	var out bytes.Buffer
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", "head -1 /etc/os-release; id -u; cat /etc/hostname; echo x > /home/user/f && cat /home/user/f; cat /proc/sys/kernel/randomize_va_space"}, Stdout: &out, Stderr: &out})
	t.Logf("cold boot -> command done: %v", time.Since(start).Round(time.Millisecond))
	// Under TCG (Accel ""), no address-space randomization: tcgArgs.
	if err != nil || end.GetExitCode() != 0 || out.String() != "ID=cage-test\n1000\ncage-01234567\nx\n0\n" {
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
	tmpl := testTemplate(b)
	runDir := testutil.RunDir(b)
	var samples []time.Duration
	for i := 0; i < b.N; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		start := time.Now()
		sb, err := Create(ctx, Config{Spec: wall.Spec{ID: fmt.Sprintf("bench%015d", i), Template: tmpl, DiskBytes: 16 << 20, Token: "t"}, RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, coldBoot: true})
		if err != nil {
			b.Fatal(err)
		}
		c := agentclient.New(sb.Dial, sb.Token())
		fw := &firstByte{}
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"x"}, Stdout: fw})
		if err != nil {
			b.Fatal(err)
		}
		fw.check(b, end.GetExitCode())
		samples = append(samples, fw.at.Sub(start))
		b.StopTimer()
		c.Close()
		_ = sb.Destroy()
		cancel()
		b.StartTimer()
	}
	reportPercentiles(b, samples)
}

// reportPercentiles reports p50, p95 and p99 of samples in milliseconds.
func reportPercentiles(b *testing.B, samples []time.Duration) {
	st := stats.Summarize(samples)
	for name, d := range map[string]time.Duration{"p50-ms": st.P50, "p95-ms": st.P95, "p99-ms": st.P99} {
		b.ReportMetric(float64(d.Microseconds())/1000, name)
	}
}

type firstByte struct{ at time.Time }

// check fails a run that failed or printed nothing: it has no time to first
// output (a zero time would give a negative sample).
func (f *firstByte) check(b *testing.B, exit int32) {
	b.Helper()
	if exit != 0 || f.at.IsZero() {
		b.Fatalf("echo exited %d and printed nothing: no time to first output", exit)
	}
}

func (f *firstByte) Write(p []byte) (int, error) {
	if f.at.IsZero() {
		f.at = time.Now()
	}
	return len(p), nil
}

// TestRestore: two sandboxes restored from one snapshot are two machines:
// each has its own token, hostname, random stream, disk and the host's
// time, and Destroy leaves nothing of either.
func TestRestore(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	type box struct {
		sb  *Sandbox
		c   *agentclient.Client
		pid int
	}
	var boxes []box
	for i, id := range []string{"aaaaaaaa00000000000001", "bbbbbbbb00000000000002"} {
		start := time.Now()
		sb, err := Create(ctx, Config{Spec: wall.Spec{ID: id, Template: tmpl, DiskBytes: 16 << 20, Token: fmt.Sprintf("token-%d", i)}, RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1})
		if err != nil {
			t.Fatalf("create %s: %v", id, err)
		}
		t.Logf("create %d: %v (restored: %v)", i, time.Since(start).Round(time.Millisecond), sb.restored)
		if !sb.restored {
			t.Errorf("sandbox %d was booted cold, not restored", i)
		}
		b := box{sb: sb, c: agentclient.New(sb.Dial, sb.Token()), pid: sb.v.Pid()}
		defer b.c.Close()
		defer sb.Destroy()
		boxes = append(boxes, b)
	}
	run := func(c *agentclient.Client, script string) (string, error) {
		var out bytes.Buffer
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &out})
		if err == nil && end.GetExitCode() != 0 {
			err = fmt.Errorf("exit %d: %s", end.GetExitCode(), out.String())
		}
		return out.String(), err
	}
	type seen struct{ hostname, etcHostname, random, disk string }
	var got []seen
	for i, b := range boxes {
		out, err := run(b.c, "hostname; cat /etc/hostname; head -c 32 /dev/urandom | busybox od -An -tx1 | tr -d ' \\n'; echo; busybox date +%s; df -k / | tail -1 | tr -s ' ' | cut -d' ' -f2 2>/dev/null || df -k /")
		host := time.Now().Unix()
		if err != nil {
			t.Fatalf("sandbox %d: %v", i, err)
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) < 5 {
			t.Fatalf("sandbox %d: %q", i, out)
		}
		got = append(got, seen{lines[0], lines[1], lines[2], lines[4]})
		if len(lines[2]) != 64 {
			t.Errorf("sandbox %d: 32 random bytes read as %q", i, lines[2])
		}
		var guest int64
		fmt.Sscan(lines[3], &guest)
		if d := guest - host; d < -5 || d > 5 {
			t.Errorf("sandbox %d: the guest's clock is %ds off the host's", i, d)
		}
		// Wrong tokens, the other sandbox's among them, are refused.
		for _, tok := range []string{"wrong", fmt.Sprintf("token-%d", 1-i)} {
			bad := agentclient.New(b.sb.Dial, tok)
			if _, err := bad.Run(ctx, agentclient.RunOptions{Cmd: "true"}); err == nil {
				t.Errorf("sandbox %d ran a command with token %q", i, tok)
			}
			bad.Close()
		}
	}
	t.Logf("seen: %+v", got)
	if mems, _ := filepath.Glob(filepath.Join(runDir, "microvm", "snapshots", "*", snapMemory)); len(mems) == 1 {
		var st syscall.Stat_t
		if err := syscall.Stat(mems[0], &st); err == nil {
			t.Logf("snapshot memory file: %d MiB, %d MiB on disk", st.Size>>20, st.Blocks*512>>20)
		}
	}
	if got[0].hostname == got[1].hostname || got[0].hostname != "cage-aaaaaaaa" || got[1].etcHostname != "cage-bbbbbbbb" {
		t.Errorf("hostnames: %+v", got)
	}
	if got[0].random == got[1].random {
		t.Errorf("both sandboxes read the same random bytes: %s", got[0].random)
	}
	// The disk is the spec's 16 MiB, not the snapshot's.
	if got[0].disk != "16384" {
		t.Errorf("the disk is %s KiB, want 16384", got[0].disk)
	}
	// Writes stay in their sandbox.
	if _, err := run(boxes[0].c, "echo a > /home/user/mine && echo a > /tmp/mine"); err != nil {
		t.Fatal(err)
	}
	if out, err := run(boxes[1].c, "cat /home/user/mine /tmp/mine 2>&1; true"); err != nil || strings.Contains(out, "a\n") {
		t.Errorf("sandbox 1 sees sandbox 0's writes: %q, %v", out, err)
	}
	for i, b := range boxes {
		b.c.Close()
		if err := b.sb.Destroy(); err != nil {
			t.Errorf("destroy %d: %v", i, err)
		}
		select {
		case <-b.sb.Exited():
		case <-time.After(10 * time.Second):
			t.Errorf("QEMU of sandbox %d still runs after Destroy", i)
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", b.pid)); !os.IsNotExist(err) {
			t.Errorf("QEMU of sandbox %d (pid %d) is still there: %v", i, b.pid, err)
		}
		if _, err := os.Stat(b.sb.dir); !os.IsNotExist(err) {
			t.Errorf("the directory of sandbox %d is left: %v", i, err)
		}
	}
}

// BenchmarkRestore: create (restored from a snapshot under TCG) -> first
// byte of `echo` from the guest's agent; building the snapshot and
// destroying are not timed. It also reports the proportional set size of
// QEMU for restored VMs (alone and twenty alive at once) and a cold-booted
// one: restored VMs share the snapshot's pages.
func BenchmarkRestore(b *testing.B) {
	k := needVM(b)
	bin := testutil.Binaries(b)
	tmpl := testTemplate(b)
	runDir := testutil.RunDir(b)
	n := 0
	create := func(ctx context.Context, cold bool) *Sandbox {
		n++
		sb, err := Create(ctx, Config{Spec: wall.Spec{ID: fmt.Sprintf("bench%015d", n), Template: tmpl, DiskBytes: 16 << 20, Token: "t"}, RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, coldBoot: cold})
		if err != nil {
			b.Fatal(err)
		}
		if !cold && !sb.restored {
			b.Fatal("booted cold, not restored")
		}
		return sb
	}
	echo := func(ctx context.Context, sb *Sandbox) (*agentclient.Client, time.Time) {
		c := agentclient.New(sb.Dial, sb.Token())
		fw := &firstByte{}
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"x"}, Stdout: fw})
		if err != nil {
			b.Fatal(err)
		}
		fw.check(b, end.GetExitCode())
		return c, fw.at
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	// The snapshot, built by the first Create.
	sb := create(ctx, false)
	c, _ := echo(ctx, sb)
	c.Close()
	_ = sb.Destroy()

	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		sb := create(ctx, false)
		c, first := echo(ctx, sb)
		samples = append(samples, first.Sub(start))
		b.StopTimer()
		c.Close()
		_ = sb.Destroy()
		b.StartTimer()
	}
	b.StopTimer()
	reportPercentiles(b, samples)

	// Memory: PSS of idle VMs, each having run one command.
	pss := func(sbs ...*Sandbox) float64 {
		time.Sleep(200 * time.Millisecond) // idle
		var sum int64
		for _, sb := range sbs {
			kb, err := pssKB(sb.v.Pid())
			if err != nil {
				b.Fatal(err)
			}
			sum += kb
		}
		return float64(sum) / float64(len(sbs)) / 1024
	}
	var alive []*Sandbox
	for range 20 {
		sb := create(ctx, false)
		c, _ := echo(ctx, sb)
		c.Close()
		alive = append(alive, sb)
		if len(alive) == 1 {
			b.ReportMetric(pss(sb), "pss-restored-alone-MiB")
		}
	}
	b.ReportMetric(pss(alive...), "pss-restored-of-20-MiB")
	for _, sb := range alive {
		_ = sb.Destroy()
	}
	cold := create(ctx, true)
	c, _ = echo(ctx, cold)
	c.Close()
	b.ReportMetric(pss(cold), "pss-cold-MiB")
	_ = cold.Destroy()
}

// pssKB is the proportional set size of process pid in KiB.
func pssKB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, err
	}
	var sum int64
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "Pss:" {
			var kb int64
			fmt.Sscan(f[1], &kb)
			sum += kb
		}
	}
	return sum, nil
}

// TestRemoveSuperseded: a new snapshot removes those of the same VM made
// with another kernel, agent or QEMU, and keeps those of other VMs.
func TestRemoveSuperseded(t *testing.T) {
	dir := t.TempDir()
	cur := shape{Kernel: "/k", Version: "6.1 b", Initramfs: "/i-new", Disks: []string{"/img"}, MemoryMB: 640, CPUs: 1, Accel: "tcg", QEMU: "q"}
	write := func(name string, s shape) {
		if err := os.MkdirAll(filepath.Join(dir, name), 0o700); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(s)
		if err := os.WriteFile(filepath.Join(dir, name, snapShape), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	oldAgent, otherSize, otherImage, withNIC := cur, cur, cur, cur
	oldAgent.Initramfs = "/i-old"
	otherSize.MemoryMB = 256
	otherImage.Disks = []string{"/img2"}
	withNIC.NIC = true
	for name, s := range map[string]shape{"cur": cur, "old-agent": oldAgent, "other-size": otherSize, "other-image": otherImage, "nic": withNIC} {
		write(name, s)
	}
	removeSuperseded(dir, "cur", cur)
	var left []string
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		left = append(left, e.Name())
	}
	if want := []string{"cur", "nic", "other-image", "other-size"}; !slices.Equal(left, want) {
		t.Errorf("left %v, want %v", left, want)
	}
}

// TestShapeKnowsTheDiskFile: a disk image made again at the same path (as
// TemplateImage does after its cache was removed) makes another shape, so
// that no snapshot or checkpoint of a VM that knew the old image is
// restored over the new one (the guest read "Bad message" from ext4).
func TestShapeKnowsTheDiskFile(t *testing.T) {
	img := filepath.Join(t.TempDir(), "t.ext4")
	if err := os.WriteFile(img, []byte("one"), 0o644); err != nil {
		t.Fatal(err)
	}
	before, err := diskFiles([]string{img})
	if err != nil {
		t.Fatal(err)
	}
	again, _ := diskFiles([]string{img})
	if !slices.Equal(before, again) {
		t.Fatalf("the same file: %v then %v", before, again)
	}
	tmp := img + ".tmp"
	if err := os.WriteFile(tmp, []byte("two"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, img); err != nil {
		t.Fatal(err)
	}
	after, err := diskFiles([]string{img})
	if err != nil {
		t.Fatal(err)
	}
	s1 := shape{Disks: []string{img}, DiskFiles: before}
	s2 := shape{Disks: []string{img}, DiskFiles: after}
	if s1.key() == s2.key() {
		t.Errorf("the image made again has the old shape's key (%v, %v)", before, after)
	}
	if _, err := diskFiles([]string{filepath.Join(t.TempDir(), "gone.ext4")}); err == nil {
		t.Error("a missing disk has an identity")
	}
}

// TestGuestArgsByAccel: under TCG the guest runs without address-space
// randomization (tcgArgs), under KVM with it; the command line is part of
// a snapshot's shape, so a snapshot made with the other one is not
// restored.
func TestGuestArgsByAccel(t *testing.T) {
	for accel, want := range map[string]bool{"": true, "tcg": true, "kvm": false} {
		args := strings.Fields(guestArgsFor(accel))
		if got := slices.Contains(args, "norandmaps"); got != want {
			t.Errorf("accel %q: %q, norandmaps %v, want %v", accel, args, got, want)
		}
		if !slices.Contains(args, "mitigations=off") || !slices.Contains(args, "ipv6.disable=1") {
			t.Errorf("accel %q: %q lacks the wall's other arguments", accel, args)
		}
	}
	if (shape{Append: guestArgsFor("tcg")}).key() == (shape{Append: guestArgs}).key() {
		t.Error("a snapshot made without the TCG arguments has the same shape key")
	}
}
