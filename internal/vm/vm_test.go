package vm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// testKernel finds the guest kernel in $CAGE_KERNEL_DIR or the repository's
// .tools/kernel, or skips.
func testKernel(t testing.TB) *Kernel {
	t.Helper()
	k, err := FindKernel(testutil.KernelDir())
	if err != nil {
		testutil.SkipWall(t, "microvm", "no guest kernel (set CAGE_KERNEL_DIR or run scripts/kernel.sh): %v", err)
	}
	return k
}

// needVM skips unless a VM can be started here: root, QEMU and a kernel.
func needVM(t testing.TB) *Kernel {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("not root: the VM tests run as root (as the microVM wall will)")
	}
	if _, err := exec.LookPath(QEMU); err != nil {
		testutil.SkipWall(t, "microvm", "%s is not installed (scripts/kernel.sh installs it)", QEMU)
	}
	return testKernel(t)
}

var guestInit struct {
	once sync.Once
	path string
	err  error
}

// buildGuestInit builds testdata/guestinit, static, once per test binary.
func buildGuestInit(t testing.TB) string {
	t.Helper()
	guestInit.once.Do(func() {
		dir, err := os.MkdirTemp("", "cage-vm-guestinit")
		if err != nil {
			guestInit.err = err
			return
		}
		guestInit.path = filepath.Join(dir, "guestinit")
		cmd := exec.Command("go", "build", "-o", guestInit.path, "./testdata/guestinit")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			guestInit.err = fmt.Errorf("build guestinit: %v\n%s", err, out)
		}
	})
	if guestInit.err != nil {
		t.Fatal(guestInit.err)
	}
	return guestInit.path
}

func TestMain(m *testing.M) {
	code := m.Run()
	if guestInit.path != "" {
		os.RemoveAll(filepath.Dir(guestInit.path))
	}
	os.Exit(code)
}

// testInitramfs writes the guest's initramfs with guestinit as /init.
func testInitramfs(t testing.TB, k *Kernel) string {
	t.Helper()
	init := buildGuestInit(t)
	p := filepath.Join(t.TempDir(), "initramfs.cpio")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteInitramfs(f, k, init, DefaultModules); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

// cpioEntry is one entry of a newc archive, as read back.
type cpioEntry struct {
	name     string
	mode     uint32
	uid, gid uint32
	mtime    uint32
	rdev     [2]uint32
	data     []byte
}

// readCpio parses a newc archive up to its trailer.
func readCpio(b []byte) ([]cpioEntry, error) {
	var out []cpioEntry
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	for {
		if off+110 > len(b) {
			return nil, fmt.Errorf("truncated header at %d", off)
		}
		h := b[off : off+110]
		if string(h[:6]) != "070701" {
			return nil, fmt.Errorf("bad magic %q at %d", h[:6], off)
		}
		var f [13]uint32
		for i := range f {
			v, err := strconv.ParseUint(string(h[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				return nil, fmt.Errorf("header at %d: %v", off, err)
			}
			f[i] = uint32(v)
		}
		// ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor,
		// rdevmajor, rdevminor, namesize, check
		nameLen, size := int(f[11]), int(f[6])
		nameEnd := off + 110 + nameLen
		if nameEnd > len(b) || nameLen == 0 || b[nameEnd-1] != 0 {
			return nil, fmt.Errorf("bad name at %d", off)
		}
		e := cpioEntry{name: string(b[off+110 : nameEnd-1]), mode: f[1], uid: f[2], gid: f[3], mtime: f[5],
			rdev: [2]uint32{f[9], f[10]}}
		dataAt := align(nameEnd)
		if dataAt+size > len(b) {
			return nil, fmt.Errorf("truncated data of %s", e.name)
		}
		e.data = b[dataAt : dataAt+size]
		off = align(dataAt + size)
		if e.name == "TRAILER!!!" {
			if off != len(b) {
				return nil, fmt.Errorf("%d bytes after the trailer", len(b)-off)
			}
			return out, nil
		}
		out = append(out, e)
	}
}

// fakeKernel makes a kernel directory with a modules.dep of its own:
// c needs b and a, b needs a, d is built in, e needs f (compressed).
func fakeKernel(t *testing.T) *Kernel {
	t.Helper()
	root := t.TempDir()
	ver := "1.0-test"
	mods := filepath.Join(root, "lib", "modules", ver)
	files := map[string]string{
		"boot/vmlinuz-" + ver:                      "kernel",
		"boot/config-" + ver:                       "CONFIG_MODULE_DECOMPRESS=y\nCONFIG_MODULE_COMPRESS_XZ=y\n",
		"lib/modules/" + ver + "/kernel/x/a.ko":    "module a",
		"lib/modules/" + ver + "/kernel/x/b.ko":    "module b",
		"lib/modules/" + ver + "/kernel/y/c-c.ko":  "module c",
		"lib/modules/" + ver + "/kernel/y/f.ko.xz": "module f",
		"lib/modules/" + ver + "/kernel/z/e.ko":    "module e",
		"lib/modules/" + ver + "/modules.builtin":  "kernel/w/d.ko\n",
		"lib/modules/" + ver + "/modules.dep": "kernel/x/a.ko:\nkernel/x/b.ko: kernel/x/a.ko\n" +
			"kernel/y/c-c.ko: kernel/x/b.ko kernel/x/a.ko\nkernel/y/f.ko.xz:\nkernel/z/e.ko: kernel/y/f.ko.xz\n",
	}
	for name, content := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	k, err := FindKernel(root)
	if err != nil {
		t.Fatal(err)
	}
	if k.Version != ver || k.Modules != mods {
		t.Fatalf("FindKernel = %+v", k)
	}
	return k
}

func TestFindKernelMissing(t *testing.T) {
	_, err := FindKernel(t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "scripts/kernel.sh") {
		t.Fatalf("FindKernel of an empty directory: %v, want an error naming scripts/kernel.sh", err)
	}
}

func TestResolveModulesFake(t *testing.T) {
	k := fakeKernel(t)
	paths, builtin, err := k.ResolveModules([]string{"c_c", "d", "e", "a"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"kernel/x/a.ko", "kernel/x/b.ko", "kernel/y/c-c.ko", "kernel/y/f.ko.xz", "kernel/z/e.ko"}
	if !slices.Equal(paths, want) || !slices.Equal(builtin, []string{"d"}) {
		t.Fatalf("ResolveModules = %v, %v; want %v, [d]", paths, builtin, want)
	}
	if _, _, err := k.ResolveModules([]string{"nope"}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("ResolveModules of an unknown module: %v", err)
	}
}

// checkInitramfs checks an archive: every entry owned by root at time zero,
// /init as given with mode 0755, and each module of paths, in
// /modules.order in that order, with its file's bytes.
func checkInitramfs(t *testing.T, b []byte, k *Kernel, initPath string, paths []string) {
	t.Helper()
	entries, err := readCpio(b)
	if err != nil {
		t.Fatalf("initramfs does not parse: %v", err)
	}
	byName := map[string]cpioEntry{}
	for _, e := range entries {
		if e.uid != 0 || e.gid != 0 || e.mtime != 0 {
			t.Errorf("%s: uid %d gid %d mtime %d, want zeros", e.name, e.uid, e.gid, e.mtime)
		}
		if _, dup := byName[e.name]; dup {
			t.Errorf("%s twice", e.name)
		}
		if dir := filepath.Dir(e.name); dir != "." {
			if d, ok := byName[dir]; !ok || d.mode&cpioDir == 0 {
				t.Errorf("%s comes before its directory", e.name)
			}
		}
		byName[e.name] = e
	}
	init, ok := byName["init"]
	want, _ := os.ReadFile(initPath)
	if !ok || init.mode != cpioReg|0o755 || !bytes.Equal(init.data, want) {
		t.Errorf("init: present %v, mode %o, %d bytes; want mode 100755, %d bytes", ok, init.mode, len(init.data), len(want))
	}
	if c := byName["dev/console"]; c.mode != cpioChar|0o600 || c.rdev != [2]uint32{5, 1} {
		t.Errorf("dev/console: mode %o rdev %v", c.mode, c.rdev)
	}
	var order []string
	for _, p := range paths {
		abs := "/lib/modules/" + k.Version + "/" + p
		order = append(order, abs)
		e, ok := byName[abs[1:]]
		want, _ := os.ReadFile(filepath.Join(k.Modules, p))
		if !ok || e.mode != cpioReg|0o644 || !bytes.Equal(e.data, want) {
			t.Errorf("%s: present %v, mode %o, %d bytes; want %d bytes", abs, ok, e.mode, len(e.data), len(want))
		}
	}
	got := strings.Fields(string(byName["modules.order"].data))
	if !slices.Equal(got, order) {
		t.Errorf("modules.order = %v, want %v", got, order)
	}
}

func TestInitramfsFake(t *testing.T) {
	k := fakeKernel(t)
	init := filepath.Join(t.TempDir(), "init")
	if err := os.WriteFile(init, []byte("#!/bin/agent\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := WriteInitramfs(&b, k, init, []string{"e", "c-c", "d"}); err != nil {
		t.Fatal(err)
	}
	checkInitramfs(t, b.Bytes(), k, init,
		[]string{"kernel/y/f.ko.xz", "kernel/z/e.ko", "kernel/x/a.ko", "kernel/x/b.ko", "kernel/y/c-c.ko"})

	// A kernel that cannot decompress modules gets none compressed.
	if err := os.WriteFile(k.Config, []byte("CONFIG_MODULE_COMPRESS_NONE=y\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := WriteInitramfs(io.Discard, k, init, []string{"e"})
	if err == nil || !strings.Contains(err.Error(), "compressed") {
		t.Fatalf("WriteInitramfs with a compressed module the kernel cannot load: %v", err)
	}
}

func TestInitramfs(t *testing.T) {
	k := testKernel(t)
	init := buildGuestInit(t)
	var a, b bytes.Buffer
	if err := WriteInitramfs(&a, k, init, DefaultModules); err != nil {
		t.Fatal(err)
	}
	if err := WriteInitramfs(&b, k, init, DefaultModules); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Fatal("two initramfs of the same inputs differ")
	}
	paths, builtin, err := k.ResolveModules(DefaultModules)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kernel %s: modules in load order %v; built in %v; initramfs %d KiB", k.Version, paths, builtin, a.Len()>>10)
	checkInitramfs(t, a.Bytes(), k, init, paths)

	// Every asked-for module is loaded or built in, and each comes after
	// all that modules.dep says it needs.
	deps, err := readModulesDep(k.Modules)
	if err != nil {
		t.Skipf("no modules.dep to check the order against: %v", err)
	}
	pos := map[string]int{}
	for i, p := range paths {
		pos[modName(p)] = i
	}
	for _, n := range DefaultModules {
		if _, ok := pos[n]; !ok && !slices.Contains(builtin, n) {
			t.Errorf("%s neither loaded nor built in", n)
		}
	}
	for _, p := range paths {
		for _, d := range deps[modName(p)].deps {
			if pd, ok := pos[d]; !ok || pd > pos[modName(p)] {
				t.Errorf("%s needs %s, which is not loaded before it", p, d)
			}
		}
	}

	// The modules' own dependency lists, read when modules.dep is missing,
	// give the same closure.
	info, err := readModinfoDeps(k.Modules)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		closure := func(mods map[string]module) []string {
			seen := map[string]bool{}
			var walk func(string)
			walk = func(n string) {
				for _, d := range mods[n].deps {
					if !seen[d] {
						seen[d] = true
						walk(d)
					}
				}
			}
			walk(modName(p))
			var out []string
			for d := range seen {
				out = append(out, d)
			}
			sort.Strings(out)
			return out
		}
		if a, b := closure(deps), closure(info); !slices.Equal(a, b) {
			t.Errorf("%s: modules.dep says %v, .modinfo says %v", p, a, b)
		}
	}
}

// bootAndHello starts a VM and reads the guest's hello; it returns the VM,
// the connection and the time from Start to the hello.
func bootAndHello(t testing.TB, ctx context.Context, cfg Config) (*VM, net.Conn, *bufio.Reader, time.Duration) {
	t.Helper()
	start := time.Now()
	v, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := v.DialAgent(ctx)
	if err != nil {
		v.Stop()
		t.Fatalf("%v\n%s", err, consoleTail(v))
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	r := bufio.NewReader(conn)
	hello, err := r.ReadString('\n')
	took := time.Since(start)
	if err != nil || hello != "hello from the guest\n" {
		conn.Close()
		v.Stop()
		t.Fatalf("hello: %q, %v\n%s", hello, err, consoleTail(v))
	}
	return v, conn, r, took
}

// consoleTail is the end of a VM's console, for failures.
func consoleTail(v *VM) string {
	b := v.Console()
	if len(b) > 3000 {
		b = b[len(b)-3000:]
	}
	return "console:\n" + b
}

// qemuChildren lists the QEMU processes whose parent is this test binary.
func qemuChildren(t testing.TB) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(stat)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || !strings.Contains(s[:i], "(qemu-system") {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(os.Getpid()) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func TestBootTCG(t *testing.T) {
	k := needVM(t)
	initrd := testInitramfs(t, k)
	images := map[string]*Kernel{"vmlinuz": {Version: k.Version, Vmlinuz: k.Vmlinuz, Modules: k.Modules}}
	if k.Vmlinux != "" {
		images["vmlinux"] = k // the uncompressed kernel, booted through PVH
	}
	for name, k := range images {
		t.Run(name, func(t *testing.T) { testBoot(t, k, initrd) })
	}
}

func testBoot(t *testing.T, k *Kernel, initrd string) {
	dir := filepath.Join(t.TempDir(), "vm,1") // a comma, which QEMU's options escape
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, conn, r, took := bootAndHello(t, ctx, Config{Kernel: k, Initramfs: initrd, Accel: "tcg", Dir: dir})
	t.Logf("boot of %s under TCG (host TSC %d kHz): start to hello %v", filepath.Base(k.Image()), hostTSCkHz(), took.Round(time.Millisecond))
	pid := v.Pid()

	for _, line := range []string{"echo me\n", "and me too\n"} {
		if _, err := io.WriteString(conn, line); err != nil {
			t.Fatal(err)
		}
		got, err := r.ReadString('\n')
		if err != nil || got != line {
			t.Fatalf("echo: %q, %v; want %q", got, err, line)
		}
	}
	// What QEMU reports of the VM for a stall's report and a trace: the
	// port's queues, which the echoes used, and TCG's translations.
	qs, err := v.VirtioQueues(ctx)
	if err != nil {
		t.Errorf("VirtioQueues: %v", err)
	} else if !regexp.MustCompile(`(?m)^virtio-serial: q0 avail \d+ taken \d+ used \d+ .*; q5 `).MatchString(qs) ||
		!regexp.MustCompile(`used [1-9]`).MatchString(qs) {
		t.Errorf("VirtioQueues: %q; want the six queues of the 2-port virtio-serial, some used", qs)
	}
	t.Logf("after the echoes, QEMU reports: %s", qs)
	if n, err := v.TranslatedBlocks(ctx); err != nil || n < 1000 {
		t.Errorf("TranslatedBlocks after a boot under TCG: %d, %v; want thousands", n, err)
	}
	// Hanging up ends the guest (it restarts, which -no-reboot makes QEMU's
	// clean exit).
	conn.Close()
	select {
	case <-v.Exited():
		if err := v.Wait(); err != nil {
			t.Errorf("QEMU ended badly after the guest's restart: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("QEMU still runs 10 s after the guest's restart\n%s", consoleTail(v))
	}
	v.Stop()
	v.Stop() // twice is fine

	if err := syscall.Kill(pid, 0); err != syscall.ESRCH {
		t.Errorf("QEMU (pid %d) is still there after Stop: %v", pid, err)
	}
	if left := qemuChildren(t); len(left) > 0 {
		t.Errorf("QEMU processes left: %v", left)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		t.Errorf("%s left in the VM's directory", e.Name())
	}
}

func TestStartErrors(t *testing.T) {
	k := needVM(t)
	initrd := filepath.Join(t.TempDir(), "initrd")
	if err := os.WriteFile(initrd, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Refused before QEMU runs, or by QEMU as it starts.
	for name, cfg := range map[string]Config{
		"accel":  {Kernel: k, Initramfs: initrd, Accel: "xen", Dir: t.TempDir()},
		"initrd": {Kernel: k, Initramfs: "/nonexistent", Dir: t.TempDir()},
		"cpus":   {Kernel: k, Initramfs: initrd, CPUs: 100000, Dir: t.TempDir()},
		"memory": {Kernel: k, Initramfs: initrd, MemoryMB: 1 << 30, Dir: t.TempDir()},
		"kernel": {Kernel: &Kernel{Vmlinuz: initrd}, Initramfs: initrd, Dir: t.TempDir()},
	} {
		v, err := Start(ctx, cfg)
		if err == nil {
			v.Stop()
			t.Errorf("%s: Start succeeded", name)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error of several lines: %q", name, err)
		}
		t.Logf("%s: %v", name, err)
	}
	if left := qemuChildren(t); len(left) > 0 {
		t.Errorf("QEMU processes left: %v", left)
	}
}

func TestProbeKVM(t *testing.T) {
	k := needVM(t)
	initrd := testInitramfs(t, k)
	start := time.Now()
	ok, reason := ProbeKVM(context.Background(), k, initrd)
	took := time.Since(start)
	t.Logf("KVM usable: %v (%s) after %v", ok, reason, took.Round(time.Millisecond))
	if !ok && reason == "" {
		t.Error("KVM unusable without a reason")
	}
	if took > probeTimeout+5*time.Second {
		t.Errorf("ProbeKVM took %v, more than its %v", took, probeTimeout)
	}
	if left := qemuChildren(t); len(left) > 0 {
		t.Errorf("QEMU processes left: %v", left)
	}
}

func BenchmarkColdBoot(b *testing.B) {
	k := needVM(b)
	initrd := testInitramfs(b, k)
	var times []time.Duration
	for i := 0; i < b.N; i++ {
		dir := b.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		v, conn, _, took := bootAndHello(b, ctx, Config{Kernel: k, Initramfs: initrd, Dir: dir})
		b.StopTimer()
		times = append(times, took)
		conn.Close()
		v.Stop()
		cancel()
		b.StartTimer()
	}
	slices.Sort(times)
	pct := func(p float64) float64 {
		i := int(p*float64(len(times))+0.999999) - 1
		i = max(0, min(i, len(times)-1))
		return float64(times[i].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.95), "p95-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
}

// TestConsoleFlood: a guest that floods its console (here 1 MiB before it
// says hello) costs the host at most ConsoleBytes of it, kept in memory
// (the last ones), and no file at all; the guest is not held up.
func TestConsoleFlood(t *testing.T) {
	k := needVM(t)
	initrd := testInitramfs(t, k)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	const flood = 1 << 20
	v, conn, _, took := bootAndHello(t, ctx, Config{Kernel: k, Initramfs: initrd, Dir: dir,
		Append: "cage.flood=" + strconv.Itoa(flood)})
	t.Logf("boot with %d bytes of console to hello: %v", flood, took.Round(time.Millisecond))
	conn.Close()
	<-v.Exited()
	v.Stop()
	con := v.Console()
	if len(con) != ConsoleBytes || !strings.Contains(con, "flood-end") || strings.Contains(con, "flood line 000000000") {
		t.Errorf("the console kept %d bytes ending %q, want the last %d", len(con), con[max(0, len(con)-80):], ConsoleBytes)
	}
	if held := v.console.held(); held > 2*ConsoleBytes {
		t.Errorf("the host holds %d bytes of console, more than %d", held, 2*ConsoleBytes)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		t.Errorf("%s left in the VM's directory", e.Name())
	}
}

// TestTail: the console's buffer keeps exactly the last max bytes
// whatever the sizes of the writes, and never holds more than twice max.
func TestTail(t *testing.T) {
	tl := &tail{max: 100}
	var all []byte
	for i, n := range []int{1, 7, 99, 100, 101, 3, 250, 1, 1, 60} {
		chunk := bytes.Repeat([]byte{byte('a' + i)}, n)
		if _, err := tl.Write(chunk); err != nil {
			t.Fatal(err)
		}
		all = append(all, chunk...)
		want := string(all[max(0, len(all)-100):])
		if got := tl.String(); got != want {
			t.Fatalf("after %d writes: %q, want %q", i+1, got, want)
		}
		if tl.held() > 200 {
			t.Fatalf("holds %d bytes", tl.held())
		}
	}
}
