package state

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// Package state is the host-side state every wall shares: reserved uid
// ranges, and sandbox state directories with their owner locks and the
// garbage collection of those whose owner died.
//
// Each sandbox maps its uids 0..65535 onto its own range of host uids, so
// that root inside is an unprivileged nobody outside, and two sandboxes never
// share a host uid (per-uid kernel limits such as inotify instances and
// RLIMIT_NPROC could otherwise be exhausted by one sandbox for all others).
const (
	idRangeSize = 65536
	idBase      = 1 << 20 // first host uid used; far above any real account
	idSlots     = 4096    // host uids up to idBase + idSlots*65536 ≈ 2^28
)

// IDRange is a host uid/gid range reserved for one sandbox. The reservation is
// an flock on a file under the run directory, so it holds across processes
// (several `cage run` at once, or a daemon) and is released by the kernel
// if its holder dies.
type IDRange struct {
	Base int
	Lock *os.File // flock'ed while reserved; pass it to whatever must hold the range
}

// IDLockDir holds the uid-range locks. It is one directory for the whole
// host, whatever run directory each cage process uses, so that no two
// sandboxes ever get the same range.
var IDLockDir = "/run/cage/ids"

func ReserveIDs() (*IDRange, error) {
	dir := IDLockDir
	if err := os.MkdirAll(filepath.Dir(dir), 0o711); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	start := rand.IntN(idSlots)
	for i := 0; i < idSlots; i++ {
		n := (start + i) % idSlots
		f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(n)), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, err
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil && sameFile(f) {
			return &IDRange{Base: idBase + n*idRangeSize, Lock: f}, nil
		}
		f.Close()
		if err != nil && !errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, err
		}
	}
	return nil, fmt.Errorf("all %d sandbox uid ranges are in use", idSlots)
}

// ReserveSlot reserves the range of slot n, as ReserveIDs would have: for
// a sandbox that must have the same slot again (its network address is in
// the memory of a checkpoint). It fails when another holds it.
func ReserveSlot(n int) (*IDRange, error) {
	if n < 0 || n >= idSlots {
		return nil, fmt.Errorf("slot %d out of range", n)
	}
	if err := os.MkdirAll(IDLockDir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(IDLockDir, strconv.Itoa(n)), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("slot %d is held by another sandbox", n)
	}
	if !sameFile(f) {
		f.Close()
		return nil, fmt.Errorf("slot %d was released meanwhile; try again", n)
	}
	return &IDRange{Base: idBase + n*idRangeSize, Lock: f}, nil
}

// release frees the range and removes its lock file.
func (s *IDRange) Release() {
	if s == nil || s.Lock == nil {
		return
	}
	_ = os.Remove(s.Lock.Name())
	s.Lock.Close()
	s.Lock = nil
}

// idMaps maps the sandbox's ids 0..65535 to the slot's host range.
func (s *IDRange) Maps() []syscall.SysProcIDMap {
	return []syscall.SysProcIDMap{{ContainerID: 0, HostID: s.Base, Size: idRangeSize}}
}

// hostID is the host uid (or gid) that sandbox id maps to.
func (s *IDRange) HostID(id int) int { return s.Base + id }

// Slot is the range's index, unique among live sandboxes on the host (the
// network gives each slot its own address and interface).
func (s *IDRange) Slot() int { return (s.Base - idBase) / idRangeSize }

// SlotHeld reports whether a live sandbox holds slot n.
func SlotHeld(n int) bool {
	f, err := os.OpenFile(filepath.Join(IDLockDir, strconv.Itoa(n)), os.O_RDWR|syscall.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return true
	}
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false
}

// sameFile reports whether f is still the file at its path: a holder that
// releases a slot unlinks its lock file, and a lock won on the unlinked inode
// reserves nothing.
func sameFile(f *os.File) bool {
	a, err1 := f.Stat()
	b, err2 := os.Stat(f.Name())
	return err1 == nil && err2 == nil && os.SameFile(a, b)
}

// gcIDLocks removes lock files of uid ranges nobody holds (their holder died
// without releasing them).
func gcIDLocks() {
	ents, err := os.ReadDir(IDLockDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		f, err := os.OpenFile(filepath.Join(IDLockDir, e.Name()), os.O_RDWR|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil && sameFile(f) {
			_ = os.Remove(f.Name())
		}
		f.Close()
	}
}
