package microvm

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/template"
)

// fakeSnapshot makes a snapshot directory of shape sh under cache whose
// memory is 1 MiB of b, and returns it.
func fakeSnapshot(t *testing.T, cache string, sh shape, b byte) snapshot {
	t.Helper()
	dir := filepath.Join(cache, "snapshots", sh.key())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, snapMemory), bytes.Repeat([]byte{b}, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(sh)
	if err := os.WriteFile(filepath.Join(dir, snapShape), js, 0o600); err != nil {
		t.Fatal(err)
	}
	return snapshot{dir}
}

// memfdOpen reports whether this process holds a descriptor of the file
// whose inode is ino (a memfd: its inode is its own).
func memfdOpen(t *testing.T, ino uint64) bool {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		var st unix.Stat_t
		if unix.Stat("/proc/self/fd/"+e.Name(), &st) == nil && st.Ino == ino && st.Nlink == 0 {
			return true
		}
	}
	return false
}

func inode(t *testing.T, f *os.File) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestSnapshotMemoryReleased: the daemon lets go of a superseded
// snapshot's memfd (some 100 MB each, held until the daemon restarted;
// found by review, 2026-12-03), and never of one a restore holds.
// Cases, each with its expected outcome:
//   - a snapshot superseded (a newer one of its shape) while a restore
//     holds its memory: the memfd stays open and whole until the restore
//     lets go, then it is closed; a later restore from it finds nothing
//     (and boots cold);
//   - a snapshot another process removed, no restore holding it: closed
//     at the next restore's sweep;
//   - a snapshot whose template was removed, or imported again as
//     another image: closed at the next sweep; one whose template is
//     still its image is kept.
func TestSnapshotMemoryReleased(t *testing.T) {
	cache := t.TempDir()
	sh := shape{Kernel: "k", Version: "1", Initramfs: "i", Disks: []string{"d"}, MemoryMB: 256, CPUs: 1, Accel: "tcg", QEMU: "old"}
	old := fakeSnapshot(t, cache, sh, 'A')
	f, release, err := old.memory(nil)
	if err != nil {
		t.Fatal(err)
	}
	ino := inode(t, f)
	newer := sh
	newer.QEMU = "new"
	fakeSnapshot(t, cache, newer, 'B')
	removeSuperseded(filepath.Join(cache, "snapshots"), newer.key(), newer)
	if _, err := os.Stat(old.dir); err == nil {
		t.Fatal("the superseded snapshot is still on disk")
	}
	// The restore in flight still holds it, whole.
	buf := make([]byte, 4)
	if _, err := f.ReadAt(buf, 1<<20-4); err != nil || string(buf) != "AAAA" {
		t.Fatalf("a held memory after it was superseded: %q, %v", buf, err)
	}
	if !memfdOpen(t, ino) {
		t.Fatal("a memory was closed while a restore held it")
	}
	release()
	release() // a second release changes nothing
	if memfdOpen(t, ino) {
		t.Error("a superseded snapshot's memory stays open after its last restore let go")
	}
	if _, _, err := old.memory(nil); err == nil {
		t.Error("a superseded snapshot's memory was loaded again")
	}

	// Removed by another process.
	other := sh
	other.CPUs = 2
	gone := fakeSnapshot(t, cache, other, 'C')
	f, release, err = gone.memory(nil)
	if err != nil {
		t.Fatal(err)
	}
	ino = inode(t, f)
	release()
	if !memfdOpen(t, ino) {
		t.Fatal("a current snapshot's memory was closed")
	}
	if err := os.RemoveAll(gone.dir); err != nil {
		t.Fatal(err)
	}
	sweepMemories()
	if memfdOpen(t, ino) {
		t.Error("the memory of a snapshot removed from disk stays open")
	}

	// Templates removed, replaced, or current.
	store, err := imgstore.Open(filepath.Join(t.TempDir(), "templates"))
	if err != nil {
		t.Fatal(err)
	}
	record := func(name, id string) {
		t.Helper()
		b, _ := json.Marshal(imgstore.Template{Name: name, ID: id})
		if err := os.WriteFile(filepath.Join(store.Dir(), "templates", name+".json"), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	tmpl := func(name, id string) *template.Template {
		return &template.Template{Name: name, Image: &template.Image{Store: store, Info: &imgstore.Template{Name: name, ID: id}}}
	}
	inos := map[string]uint64{}
	for i, name := range []string{"removed", "replaced", "current"} {
		s := sh
		s.MemoryMB = 512 + 64*i
		id := "sha256:" + strconv.Itoa(i)
		record(name, id)
		f, release, err := fakeSnapshot(t, cache, s, 'D').memory(tmpl(name, id))
		if err != nil {
			t.Fatal(err)
		}
		inos[name] = inode(t, f)
		release()
	}
	if err := os.Remove(filepath.Join(store.Dir(), "templates", "removed.json")); err != nil {
		t.Fatal(err)
	}
	record("replaced", "sha256:another")
	sweepMemories()
	for name, want := range map[string]bool{"removed": false, "replaced": false, "current": true} {
		if got := memfdOpen(t, inos[name]); got != want {
			t.Errorf("template %s: its snapshot's memory open: %v, want %v", name, got, want)
		}
	}
}

// TestSnapshotMemoryEvicted: a tenant choosing limits picks the VM's
// shape (RAM class, vCPUs), and each shape's snapshot memory (some 100 MB)
// stayed in the daemon for as long as its snapshot was current (found by
// review, 2026-12-03). Expected: past maxMemories, the least recently
// restored are let go (a restore holding one keeps it until it lets go);
// one not restored for memIdle is let go; a memory let go is loaded from
// its file again at its next restore.
func TestSnapshotMemoryEvicted(t *testing.T) {
	saved := maxMemories
	maxMemories = 3
	defer func() { maxMemories = saved }()
	cache := t.TempDir()
	base := shape{Kernel: "k", Version: "1", Initramfs: "i", Disks: []string{"d"}, CPUs: 1, Accel: "tcg", QEMU: "q"}
	var snaps []snapshot
	var inos []uint64
	var held func()
	for i := range 5 {
		sh := base
		sh.MemoryMB = 256 + 64*i
		s := fakeSnapshot(t, cache, sh, byte('a'+i))
		f, release, err := s.memory(nil)
		if err != nil {
			t.Fatal(err)
		}
		snaps, inos = append(snaps, s), append(inos, inode(t, f))
		if i == 0 {
			held = release // a restore of the first still in flight
		} else {
			release()
		}
		time.Sleep(2 * time.Millisecond) // distinct times of use
	}
	sweepMemories()
	// The two least recently restored are let go; the one a restore
	// holds stays open until it lets go.
	for i, want := range []bool{true, false, true, true, true} {
		if got := memfdOpen(t, inos[i]); got != want {
			t.Errorf("shape %d of 5 (3 kept): memory open %v, want %v", i, got, want)
		}
	}
	held()
	if memfdOpen(t, inos[0]) {
		t.Error("an evicted memory stays open after its restore let go")
	}
	// Let go, it is loaded again (its file is still the snapshot's).
	f, release, err := snaps[1].memory(nil)
	if err != nil {
		t.Fatalf("restore of an evicted snapshot: %v", err)
	}
	buf := make([]byte, 2)
	if _, err := f.ReadAt(buf, 0); err != nil || string(buf) != "bb" {
		t.Errorf("an evicted snapshot's memory, loaded again: %q, %v", buf, err)
	}
	release()
	// Idle for memIdle: let go.
	savedIdle := memIdle
	memIdle = time.Millisecond
	defer func() { memIdle = savedIdle }()
	time.Sleep(5 * time.Millisecond)
	sweepMemories()
	for i := range inos {
		if memfdOpen(t, inos[i]) {
			t.Errorf("shape %d: memory open after memIdle without a restore", i)
		}
	}
	memories.Lock()
	left := len(memories.m)
	memories.Unlock()
	if left != 0 {
		t.Errorf("%d memories kept after memIdle; want none", left)
	}
}
