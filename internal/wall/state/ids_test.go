package state

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestSlotLocks: a slot is reserved while its host's lock or the
// sandbox's own is held; the sandbox's is read-only and letting it go
// frees nothing while the host's is held; a host that comes back to a
// sandbox that outlived it (AdoptSlot) gets the host's lock again.
func TestSlotLocks(t *testing.T) {
	old := IDLockDir
	IDLockDir = t.TempDir()
	defer func() { IDLockDir = old }()

	r, err := ReserveIDs()
	if err != nil {
		t.Fatal(err)
	}
	n := r.Slot()
	if _, err := r.Held.Write([]byte("x")); err == nil {
		t.Error("the sandbox's lock file is writable")
	}
	// A hostile sandbox lets its own lock go: the host's keeps the slot.
	if err := syscall.Flock(int(r.Held.Fd()), syscall.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	if _, err := ReserveSlot(n); err == nil {
		t.Fatal("slot reserved twice: the sandbox let its own lock go")
	}
	if !SlotHeld(n) {
		t.Error("SlotHeld: false while the host holds its lock")
	}
	r.Release()
	if SlotHeld(n) {
		t.Error("SlotHeld: true after the release")
	}

	// The host goes (its lock with it); the sandbox lives on, holding its
	// own: the slot stays reserved, and the host adopts it again.
	r, err = ReserveSlot(n)
	if err != nil {
		t.Fatal(err)
	}
	r.Lock.Close()
	r.Lock = nil
	if _, err := ReserveSlot(n); err == nil {
		t.Fatal("slot reserved while its sandbox still holds its own lock")
	}
	if _, err := os.Stat(filepath.Join(IDLockDir, strconv.Itoa(n))); err == nil {
		t.Error("a reservation that lost the sandbox's lock left the host's lock file behind")
	}
	GCIDLocks() // must not remove what a live sandbox holds
	a, err := AdoptSlot(n)
	if err != nil {
		t.Fatalf("adopt: %v", err)
	}
	if a.Held != nil {
		t.Error("adopt took the lock the sandbox holds")
	}
	if _, err := AdoptSlot(n); err == nil {
		t.Error("a second host adopted the same slot")
	}
	r.Release() // the sandbox ends
	a.Release()
	if _, err := os.Stat(IDLockDir); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(IDLockDir); len(ents) != 0 {
		t.Errorf("lock files left after every release: %d", len(ents))
	}
}

// TestHeldLockImmutable: the sandbox's lock file is immutable while a
// reservation holds it (no one changes its times, mode, owner or content
// through a descriptor of it: gVisor's sentry did, for root inside,
// futimens), flock still works on it, and a release or a GC removes it.
func TestHeldLockImmutable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the immutable attribute needs root")
	}
	old := IDLockDir
	IDLockDir = t.TempDir()
	defer func() { IDLockDir = old }()
	t.Cleanup(func() { // a failed test leaves no file TempDir cannot remove
		ents, _ := os.ReadDir(IDLockDir)
		for _, e := range ents {
			if f, err := os.Open(filepath.Join(IDLockDir, e.Name())); err == nil {
				immutable(f, false)
				f.Close()
			}
		}
	})
	r, err := ReserveIDs()
	if err != nil {
		t.Fatal(err)
	}
	flags, err := unix.IoctlGetUint32(int(r.Held.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		t.Skipf("%s has no file attributes: %v", IDLockDir, err)
	}
	if flags&0x10 == 0 {
		t.Fatalf("the sandbox's lock file has attributes %#x, want FS_IMMUTABLE_FL", flags)
	}
	fd := int(r.Held.Fd())
	for what, err := range map[string]error{
		"futimens": unix.UtimesNanoAt(fd, "", []unix.Timespec{{Sec: 1}, {Sec: 1}}, unix.AT_EMPTY_PATH),
		"fchmod":   unix.Fchmod(fd, 0o4777),
		"fchown":   unix.Fchown(fd, 1234, 1234),
		"unlink":   os.Remove(r.Held.Name()),
	} {
		if err == nil {
			t.Errorf("%s of the sandbox's lock file succeeded (as root)", what)
		}
	}
	if err := syscall.Flock(fd, syscall.LOCK_UN); err != nil {
		t.Errorf("flock: %v", err)
	}
	if err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Errorf("flock: %v", err)
	}
	held := r.Held.Name()
	r.Release()
	if _, err := os.Lstat(held); !os.IsNotExist(err) {
		t.Errorf("after the release the sandbox's lock file is still there (%v)", err)
	}
	// A holder that died leaves the files, immutable: GC removes them.
	r, err = ReserveIDs()
	if err != nil {
		t.Fatal(err)
	}
	held = r.Held.Name()
	r.Close()
	GCIDLocks()
	if _, err := os.Lstat(held); !os.IsNotExist(err) {
		t.Errorf("after GC a dead holder's lock file is still there (%v)", err)
	}
}
