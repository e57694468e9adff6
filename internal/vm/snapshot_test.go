package vm

import (
	"context"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSnapshotArgs: a snapshot's VM and a restored one differ on the
// command line only in how the RAM file is mapped, the paths of their own
// directory, and the restored one's waiting for its state.
func TestSnapshotArgs(t *testing.T) {
	k := &Kernel{Version: "6.1", Vmlinuz: "/k/vmlinuz"}
	base := Config{Kernel: k, Initramfs: "/i.cpio", MemoryMB: 128, Disks: []string{"/d.ext4"}, MemoryFile: "/snap/mem,1"}
	snap, rest := base, base
	snap.Dir, snap.ShareMemory = "/a", true
	rest.Dir, rest.incoming = "/b", true
	sa, ra := strings.Join(snap.Args(), " "), strings.Join(rest.Args(), " ")
	for _, want := range []string{"memory-backend-file,id=mem,size=128M,mem-path=/snap/mem,,1,share=on", ",memory-backend=mem"} {
		if !strings.Contains(sa, want) {
			t.Errorf("snapshot args lack %q: %s", want, sa)
		}
	}
	if !strings.Contains(ra, "share=off") || !slices.Contains(rest.Args(), "-incoming") {
		t.Errorf("restore args: %s", ra)
	}
	if slices.Contains(snap.Args(), "-incoming") {
		t.Errorf("snapshot args wait for a migration: %s", sa)
	}
	norm := func(s string) string {
		s = strings.ReplaceAll(s, "share=on", "share=X")
		s = strings.ReplaceAll(s, "share=off", "share=X")
		s = strings.TrimSuffix(s, " -incoming defer")
		return strings.ReplaceAll(strings.ReplaceAll(s, "/a/", "/D/"), "/b/", "/D/")
	}
	if norm(sa) != norm(ra) {
		t.Errorf("the two machines differ:\n%s\n%s", sa, ra)
	}
}

// TestSnapshotRestore: a guest saved while blocked in its hello runs again
// in two VMs restored from one snapshot, each greeting its own host.
func TestSnapshotRestore(t *testing.T) {
	k := needVM(t)
	initrd := testInitramfs(t, k)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	mem, state := filepath.Join(dir, "memory"), filepath.Join(dir, "state")
	cfg := Config{Kernel: k, Initramfs: initrd, MemoryMB: 128, Dir: filepath.Join(dir, "src"), MemoryFile: mem, ShareMemory: true}
	v, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// No host connects: the guest boots and blocks writing its hello. Two
	// seconds is about a boot under TCG, but a guest saved earlier only
	// gets there after the restore.
	time.Sleep(2 * time.Second)
	if err := v.Snapshot(ctx, state); err != nil {
		v.Stop()
		t.Fatalf("%v\n%s", err, consoleTail(v))
	}
	v.Stop()
	if err := (&VM{cfg: Config{}}).Snapshot(ctx, state); err == nil {
		t.Error("a snapshot of a VM without a shared memory file")
	}

	var vms []*VM
	for i, name := range []string{"r1", "r2"} {
		rc := cfg
		rc.Dir, rc.ShareMemory = filepath.Join(dir, name), false
		start := time.Now()
		r, err := Restore(ctx, rc, state)
		if err != nil {
			t.Fatalf("restore %d: %v", i, err)
		}
		vms = append(vms, r)
		defer r.Stop()
		conn, err := r.DialAgent(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(20 * time.Second))
		buf := make([]byte, len("hello from the guest\n")+len("ping\n"))
		if _, err := io.WriteString(conn, "ping\n"); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "hello from the guest\nping\n" {
			t.Fatalf("restored guest %d: %q, %v\n%s", i, buf, err, consoleTail(r))
		}
		t.Logf("restore %d -> hello and echo: %v (a guest saved before its hello boots on first)", i, time.Since(start).Round(time.Millisecond))
	}
	for _, r := range vms {
		pid := r.Pid()
		r.Stop()
		if err := syscall.Kill(pid, 0); err != syscall.ESRCH {
			t.Errorf("QEMU (pid %d) is still there after Stop: %v", pid, err)
		}
	}
	if _, err := Restore(ctx, Config{Kernel: k, Initramfs: initrd, Dir: filepath.Join(dir, "r3"), MemoryFile: filepath.Join(dir, "none")}, state); err == nil {
		t.Error("a restore without its memory file")
	}
}
