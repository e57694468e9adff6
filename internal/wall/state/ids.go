package state

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
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
//
// A slot has two lock files, both of which a reservation wins: the host's
// (N), which never leaves the process that reserved it, and the sandbox's
// (N.held), locked on an open file of its own, read-only, which the
// sandbox's process inherits so that the range stays reserved while the
// sandbox lives (a daemon's restart, a killed `cage run`). flock's locks
// belong to an open file, not to a process: a sandbox handed the host's
// own could unlock it (or write to it), and a second sandbox would get the
// range of one that still runs. Unlocking its own only loses the sandbox
// its claim once the host's holder is gone.
//
// The sandbox's file is immutable while a reservation holds it (see
// immutable): gVisor's sentry runs as root of a user namespace that maps
// every host id, with CAP_FOWNER, and did for root inside what it asked
// of the descriptor it was passed: futimens set the host file's times
// (found by review, 2026-12-03: its mtime read 1970-01-01 00:00:01).
// fchmod, fchown, writes, a truncate and a reopen through /proc/self/fd
// never reached the host's file.
type IDRange struct {
	Base int
	Lock *os.File // the host's lock: never handed to a sandbox
	Held *os.File // the sandbox's lock: pass it to whatever must hold the range
}

// IDLockDir holds the uid-range locks. It is one directory for the whole
// host, whatever run directory each cage process uses, so that no two
// sandboxes ever get the same range.
var IDLockDir = "/run/cage/ids"

// heldSuffix names a slot's second lock file (see IDRange).
const heldSuffix = ".held"

func lockDir() error {
	if err := os.MkdirAll(filepath.Dir(IDLockDir), 0o711); err != nil {
		return err
	}
	return os.MkdirAll(IDLockDir, 0o700)
}

// lockFile opens (creating) path with flags and takes an exclusive flock
// on it without waiting. busy says another holds it. A lock won on a file
// unlinked meanwhile (its holder released it) is tried again.
func lockFile(path string, flags int) (f *os.File, busy bool, err error) {
	for try := 0; ; try++ {
		f, err = os.OpenFile(path, os.O_CREATE|flags|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, false, err
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil && sameFile(f) {
			return f, false, nil
		}
		f.Close()
		if err != nil {
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, true, nil
			}
			return nil, false, err
		}
		if try == 3 {
			return nil, true, nil
		}
	}
}

// reserve wins slot n's two locks, or neither (busy: another holds one).
func reserve(n int) (r *IDRange, busy bool, err error) {
	name := filepath.Join(IDLockDir, strconv.Itoa(n))
	host, busy, err := lockFile(name, os.O_RDWR)
	if host == nil {
		return nil, busy, err
	}
	held, busy, err := lockFile(name+heldSuffix, os.O_RDONLY)
	if held != nil {
		immutable(held, true)
	}
	if held == nil {
		// A sandbox whose host process is gone still holds the slot:
		// the host's file, made here, goes again (while still locked, so
		// that nobody takes a lock on it meanwhile that would count).
		_ = os.Remove(name)
		host.Close()
		return nil, busy, err
	}
	return &IDRange{Base: idBase + n*idRangeSize, Lock: host, Held: held}, false, nil
}

func ReserveIDs() (*IDRange, error) {
	if err := lockDir(); err != nil {
		return nil, err
	}
	start := rand.IntN(idSlots)
	taken := 0
	for i := 0; i < idSlots; i++ {
		n := (start + i) % idSlots
		if slotTaken(n) {
			taken++
			continue
		}
		r, busy, err := reserve(n)
		if r != nil {
			return r, nil
		}
		if !busy {
			return nil, err
		}
	}
	if taken > 0 {
		return nil, fmt.Errorf("all %d sandbox uid ranges are in use (%d of them hold ids of the host's users: %s, %s, %s, %s)",
			idSlots, taken, hostIDFiles.subuid, hostIDFiles.subgid, hostIDFiles.passwd, hostIDFiles.group)
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
	if slotTaken(n) {
		return nil, fmt.Errorf("slot %d's host ids are now a host user's (%s, %s, %s, %s)", n,
			hostIDFiles.subuid, hostIDFiles.subgid, hostIDFiles.passwd, hostIDFiles.group)
	}
	if err := lockDir(); err != nil {
		return nil, err
	}
	r, busy, err := reserve(n)
	if busy {
		return nil, fmt.Errorf("slot %d is held by another sandbox", n)
	}
	return r, err
}

// AdoptSlot takes the host's lock of slot n again for a sandbox that
// outlived its host process and holds the slot's own lock (see IDRange),
// and its own lock too where the sandbox does not hold it (one restored
// from a checkpoint). It fails when another holds the host's lock.
func AdoptSlot(n int) (*IDRange, error) {
	if n < 0 || n >= idSlots {
		return nil, fmt.Errorf("slot %d out of range", n)
	}
	if err := lockDir(); err != nil {
		return nil, err
	}
	name := filepath.Join(IDLockDir, strconv.Itoa(n))
	host, busy, err := lockFile(name, os.O_RDWR)
	if host == nil {
		if busy {
			return nil, fmt.Errorf("slot %d is held by another sandbox", n)
		}
		return nil, err
	}
	r := &IDRange{Base: idBase + n*idRangeSize, Lock: host}
	if r.Held, _, _ = lockFile(name+heldSuffix, os.O_RDONLY); r.Held != nil {
		immutable(r.Held, true)
	}
	return r, nil
}

// Close lets go of the range's locks without releasing the range's files
// (a holder that hands the slot on to the next, see manager's restore).
func (s *IDRange) Close() {
	if s == nil {
		return
	}
	for _, f := range []**os.File{&s.Held, &s.Lock} {
		if *f != nil {
			(*f).Close()
			*f = nil
		}
	}
}

// release frees the range and removes its lock files: the sandbox's
// first, while the host's still keeps the slot.
func (s *IDRange) Release() {
	if s == nil {
		return
	}
	for _, f := range []**os.File{&s.Held, &s.Lock} {
		if *f != nil {
			immutable(*f, false)
			_ = os.Remove((*f).Name())
			(*f).Close()
			*f = nil
		}
	}
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

// SlotHeld reports whether a live sandbox holds slot n: its host's lock
// or its own.
func SlotHeld(n int) bool {
	name := filepath.Join(IDLockDir, strconv.Itoa(n))
	for _, p := range []string{name, name + heldSuffix} {
		f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		}
		f.Close()
		if err != nil {
			return true
		}
	}
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

// GCIDLocks removes lock files of uid ranges nobody holds (their holder died
// without releasing them).
func GCIDLocks() {
	ents, err := os.ReadDir(IDLockDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		f, err := os.OpenFile(filepath.Join(IDLockDir, e.Name()), os.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil && sameFile(f) {
			immutable(f, false)
			_ = os.Remove(f.Name())
		}
		f.Close()
	}
}

// immutable sets or clears a lock file's immutable attribute (FS_IMMUTABLE_FL,
// which root holds CAP_LINUX_IMMUTABLE to change): set, no one may change
// its times, mode, owner or content, nor remove it, while flock still
// works. Best effort: a file system without attributes keeps the file as
// it is.
func immutable(f *os.File, on bool) {
	const immutableFlag = 0x10 // FS_IMMUTABLE_FL, linux/fs.h
	fd := int(f.Fd())
	flags, err := unix.IoctlGetUint32(fd, unix.FS_IOC_GETFLAGS)
	if err != nil {
		return
	}
	want := flags &^ immutableFlag
	if on {
		want |= immutableFlag
	}
	if want != flags {
		_ = unix.IoctlSetPointerInt(fd, unix.FS_IOC_SETFLAGS, int(want))
	}
}
