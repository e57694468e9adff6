package microvm

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall"
)

// TestQEMUJail: a guest that escapes into QEMU finds nothing of the host.
// QEMU's network namespace is its own and holds only lo (its NIC is a tap
// descriptor); its mount namespace is its own, its root a read-only tmpfs
// with /usr (QEMU, its libraries and firmware; read-only, mounts under it
// too), the links or binds of the
// top-level library directories, a /dev of harmless nodes and its own
// /proc; no /root, /home, /run, /etc, /var, no run or data directory of
// cage's; its PID namespace shows QEMU alone; it runs as its own uid with
// no capabilities, and holds no descriptor of a directory.
func TestQEMUJail(t *testing.T) {
	k := needVM(t)
	bin := testutil.Binaries(t)
	tmpl := testTemplate(t)
	runDir := testutil.RunDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sb, err := Create(ctx, Config{Spec: wall.Spec{ID: "0123456789abcdef0124", Template: tmpl, DiskBytes: 16 << 20, Token: "secret"}, RunDir: runDir, AgentPath: filepath.Join(bin, "cage-agent"), Kernel: k, MemoryMB: 256, CPUs: 1, coldBoot: true})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	defer sb.Destroy()
	pid := strconv.Itoa(sb.AgentPID())
	proc := "/proc/" + pid

	for _, ns := range []string{"net", "mnt", "pid", "ipc", "uts"} {
		q, err := os.Readlink(proc + "/ns/" + ns)
		if err != nil {
			t.Fatal(err)
		}
		for _, other := range []string{"/proc/1/ns/" + ns, "/proc/self/ns/" + ns} {
			if o, _ := os.Readlink(other); o == q {
				t.Errorf("QEMU shares its %s namespace with %s (%s)", ns, other, q)
			}
		}
	}
	dev, err := os.ReadFile(proc + "/net/dev")
	if err != nil {
		t.Fatal(err)
	}
	var ifaces []string
	for _, line := range strings.Split(string(dev), "\n")[2:] {
		if name, _, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			ifaces = append(ifaces, name)
		}
	}
	if !slices.Equal(ifaces, []string{"lo"}) {
		t.Errorf("QEMU's network namespace has %v, want lo alone", ifaces)
	}

	ents, err := os.ReadDir(proc + "/root")
	if err != nil {
		t.Fatal(err)
	}
	allowed := map[string]bool{"usr": true, "dev": true, "proc": true, "bin": true, "sbin": true,
		"lib": true, "lib64": true, "lib32": true, "libx32": true}
	for _, e := range ents {
		if !allowed[e.Name()] {
			t.Errorf("QEMU's root holds /%s", e.Name())
		}
	}
	mounts, err := os.ReadFile(proc + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(mounts)), "\n") {
		f := strings.Fields(line)
		mp := f[4]
		ok := mp == "/" || mp == "/proc" || mp == "/dev" || strings.HasPrefix(mp, "/dev/") ||
			mp == "/usr" || strings.HasPrefix(mp, "/usr/") || allowed[strings.TrimPrefix(mp, "/")]
		if !ok || strings.Contains(line, runDir) || strings.Contains(line, "/root") || strings.Contains(line, "/home") {
			t.Errorf("QEMU's mount namespace shows %q", line)
		}
		if (mp == "/" || mp == "/usr" || strings.HasPrefix(mp, "/usr/")) && !strings.HasPrefix(f[5]+",", "ro,") {
			t.Errorf("QEMU's %s is not read-only: %q", mp, line)
		}
	}
	for _, p := range []string{"/root", "/home", "/etc", "/run", "/var", "/tmp", runDir} {
		if _, err := os.Lstat(proc + "/root" + p); err == nil {
			t.Errorf("QEMU sees %s", p)
		}
	}
	devs, _ := os.ReadDir(proc + "/root/dev")
	var names []string
	for _, d := range devs {
		names = append(names, d.Name())
	}
	want := []string{"null", "random", "urandom", "zero"} // under TCG: no kvm
	if !slices.Equal(names, want) {
		t.Errorf("QEMU's /dev: %v, want %v", names, want)
	}
	pids, _ := os.ReadDir(proc + "/root/proc")
	for _, p := range pids {
		if n, err := strconv.Atoi(p.Name()); err == nil && n != 1 {
			t.Errorf("QEMU's /proc shows a process %d besides itself", n)
		}
	}

	status, err := os.ReadFile(proc + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "Uid:", "Gid:":
			for _, id := range f[1:] {
				if id != strconv.Itoa(sb.ids.Base) {
					t.Errorf("QEMU's %s %v, want %d throughout", f[0], f[1:], sb.ids.Base)
					break
				}
			}
		case "CapEff:", "CapPrm:", "CapAmb:":
			if f[1] != "0000000000000000" {
				t.Errorf("QEMU holds capabilities: %s", line)
			}
		case "NoNewPrivs:":
			if f[1] != "1" {
				t.Errorf("QEMU runs without no_new_privs: %s", line)
			}
		}
	}
	fds, err := os.ReadDir(proc + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		target, _ := os.Readlink(proc + "/fd/" + fd.Name())
		var st os.FileInfo
		if st, err = os.Stat(proc + "/fd/" + fd.Name()); err == nil && st.IsDir() {
			t.Errorf("QEMU holds a directory: fd %s -> %s", fd.Name(), target)
		}
	}
}
