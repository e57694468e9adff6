package state

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
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
	gcIDLocks() // must not remove what a live sandbox holds
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
