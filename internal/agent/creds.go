package agent

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Acting as the requesting user. Every file operation runs on an OS thread
// whose credentials are the user's, so that the kernel checks it exactly as
// it would check that user's shell: permissions, sticky directories,
// protected symlinks, ownership of what it creates. The agent's privileges
// (its capabilities: DAC override, fowner, chown, ...) never apply to a
// request, and no symlink a request follows can lead it anywhere the user
// could not go.
//
// Credentials are per thread in Linux. On a locked thread, the agent sets
// the supplementary groups (to none, as the commands it starts have), the
// filesystem gid and uid (setfsgid/setfsuid; gVisor lacks them, so there
// the effective ids, which it checks files against), and empties the
// thread's effective capability set; afterwards it restores all of it and
// checks that it did. Every call is a raw system call on the one thread
// (Go's syscall.Setgroups and friends change every thread of the process).
// A thread that cannot be restored is never unlocked: the runtime ends it
// with its goroutine. Root acts as uid 0 of the sandbox without
// capabilities, as commands run as root do.
//
// Changing a thread's fs or effective ids makes the kernel reset the
// process's dumpable flag and the thread's parent-death signal; both are
// put back at once (see internal/seal: /proc/1 belongs to the agent's uid
// only while the process is dumpable).

// threadCreds is what a thread held before it took a user's credentials.
type threadCreds struct {
	switched     bool
	fsuid, fsgid uint32
	groups       []uint32
	caps         [2]unix.CapUserData
	dumpable     int
	pdeath       int
}

// fsIDCalls reports whether the kernel has setfsuid/setfsgid (gVisor
// answers ENOSYS). setfsuid(-1) changes nothing and returns the current id.
var fsIDCalls = sync.OnceValue(func() bool {
	_, _, errno := unix.RawSyscall(unix.SYS_SETFSUID, noID, 0, 0)
	return errno == 0
})

// noID is (uid_t)-1: "leave unchanged" to the set*id calls.
const noID = uintptr(1<<32 - 1)

func capHeader() *unix.CapUserHeader {
	return &unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3} // Pid 0: this thread
}

// fsIDs returns the calling thread's filesystem uid and gid.
func fsIDs() (uint32, uint32) {
	if !fsIDCalls() {
		return uint32(unix.Geteuid()), uint32(unix.Getegid())
	}
	uid, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, noID, 0, 0)
	gid, _, _ := unix.RawSyscall(unix.SYS_SETFSGID, noID, 0, 0)
	return uint32(uid), uint32(gid)
}

// setFSIDs sets the calling thread's filesystem uid and gid.
func setFSIDs(uid, gid uint32) {
	if fsIDCalls() {
		unix.RawSyscall(unix.SYS_SETFSGID, uintptr(gid), 0, 0)
		unix.RawSyscall(unix.SYS_SETFSUID, uintptr(uid), 0, 0)
		return
	}
	unix.RawSyscall(unix.SYS_SETRESGID, noID, uintptr(gid), noID)
	unix.RawSyscall(unix.SYS_SETRESUID, noID, uintptr(uid), noID)
}

func threadGroups() ([]uint32, error) {
	n, _, errno := unix.RawSyscall(unix.SYS_GETGROUPS, 0, 0, 0)
	if errno != 0 {
		return nil, errno
	}
	if n == 0 {
		return nil, nil
	}
	gs := make([]uint32, n)
	n, _, errno = unix.RawSyscall(unix.SYS_GETGROUPS, n, uintptr(unsafe.Pointer(&gs[0])), 0)
	if errno != 0 {
		return nil, errno
	}
	return gs[:n], nil
}

func setThreadGroups(gs []uint32) error {
	var p uintptr
	if len(gs) > 0 {
		p = uintptr(unsafe.Pointer(&gs[0]))
	}
	if _, _, errno := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(gs)), p, 0); errno != 0 {
		return errno
	}
	return nil
}

// setEffective sets the thread's effective capabilities, keeping the rest.
func setEffective(saved [2]unix.CapUserData, eff [2]uint32) error {
	data := saved
	data[0].Effective, data[1].Effective = eff[0], eff[1]
	return unix.Capset(capHeader(), &data[0])
}

func effective() ([2]uint32, error) {
	var data [2]unix.CapUserData
	err := unix.Capget(capHeader(), &data[0])
	return [2]uint32{data[0].Effective, data[1].Effective}, err
}

// saveCreds reads what becomeUser changes on the calling thread.
func saveCreds() (threadCreds, error) {
	var c threadCreds
	if err := unix.Capget(capHeader(), &c.caps[0]); err != nil {
		return c, fmt.Errorf("capget: %w", err)
	}
	var err error
	if c.groups, err = threadGroups(); err != nil {
		return c, fmt.Errorf("getgroups: %w", err)
	}
	c.fsuid, c.fsgid = fsIDs()
	c.dumpable, _ = unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
	_ = unix.Prctl(unix.PR_GET_PDEATHSIG, uintptr(unsafe.Pointer(&c.pdeath)), 0, 0, 0)
	return c, nil
}

// fixProcess puts back what a change of ids resets.
func (c *threadCreds) fixProcess() {
	if c.dumpable == 1 {
		_ = unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0)
	}
	if c.pdeath != 0 {
		_ = unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(c.pdeath), 0, 0, 0)
	}
}

// becomeUser gives the calling (locked) thread u's credentials with no
// capabilities. An agent without capabilities (tests run unprivileged) can
// act only as itself, and does so unchanged.
func becomeUser(u User) (threadCreds, error) {
	c, err := saveCreds()
	if err != nil {
		return c, err
	}
	if u.UID < 0 || u.UID > maxID || u.GID < 0 || u.GID > maxID {
		return c, fmt.Errorf("act as uid %d gid %d: %w", u.UID, u.GID, unix.EINVAL)
	}
	uid, gid := uint32(u.UID), uint32(u.GID)
	if c.caps[0].Permitted == 0 && c.caps[1].Permitted == 0 {
		if uid == c.fsuid && gid == c.fsgid {
			return c, nil
		}
		return c, fmt.Errorf("act as uid %d: the agent has no privilege to: %w", uid, unix.EPERM)
	}
	c.switched = true
	if len(c.groups) > 0 { // the sealed agent has none
		if err := setThreadGroups(nil); err != nil {
			return c, fmt.Errorf("setgroups: %w", err)
		}
	}
	setFSIDs(uid, gid)
	// After the ids: a change of fsuid to 0 raises the filesystem
	// capabilities again, from the permitted set.
	if err := setEffective(c.caps, [2]uint32{}); err != nil {
		return c, fmt.Errorf("capset: %w", err)
	}
	c.fixProcess()
	gotUID, gotGID := fsIDs()
	eff, err := effective()
	groups, gerr := threadGroups()
	if err != nil || gerr != nil || gotUID != uid || gotGID != gid || eff != [2]uint32{} || len(groups) != 0 {
		return c, fmt.Errorf("act as uid %d gid %d: got uid %d gid %d, capabilities %x, %d groups: %w",
			uid, gid, gotUID, gotGID, eff, len(groups), unix.EPERM)
	}
	return c, nil
}

// restore gives the calling thread back what it held before becomeUser,
// and reports whether it did.
func (c *threadCreds) restore() bool {
	if !c.switched {
		return true
	}
	want := [2]uint32{c.caps[0].Effective, c.caps[1].Effective}
	if setEffective(c.caps, want) != nil {
		return false
	}
	setFSIDs(c.fsuid, c.fsgid)
	if len(c.groups) > 0 && setThreadGroups(c.groups) != nil {
		return false
	}
	// Again: a change of fsuid from 0 drops the filesystem capabilities.
	if setEffective(c.caps, want) != nil {
		return false
	}
	c.fixProcess()
	uid, gid := fsIDs()
	eff, err := effective()
	groups, gerr := threadGroups()
	return err == nil && gerr == nil && uid == c.fsuid && gid == c.fsgid && eff == want && equalIDs(groups, c.groups)
}

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// onThread runs fn on a goroutine locked to an OS thread that is not the
// process's main thread (whose ids name the owner of /proc/PID), and waits.
// fn reports whether the thread is as it found it; if not, the thread stays
// locked and the runtime ends it with the goroutine. A panic in fn reaches
// the caller; its thread is ended too.
func onThread(fn func() (clean bool)) {
	done := make(chan struct{})
	var panicked any
	go func() {
		defer close(done)
		defer func() {
			if r := recover(); r != nil {
				panicked = r
			}
		}()
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The main thread: keep it while another does the work.
			onThread(fn)
			runtime.UnlockOSThread()
			return
		}
		if fn() {
			runtime.UnlockOSThread()
		}
	}()
	<-done
	if panicked != nil {
		panic(panicked)
	}
}

// asUser runs fn as u (see above), on one of at most fileWorkers threads:
// each may block in a system call, and the agent's threads are a fixed
// budget (a workload can take every other pid of the sandbox).
func (s *Server) asUser(ctx context.Context, u User, fn func() error) error {
	select {
	case s.fileWork <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-s.fileWork }()
	var err error
	onThread(func() bool {
		c, berr := becomeUser(u)
		if berr == nil {
			err = fn()
		} else {
			err = berr
		}
		if !c.restore() {
			s.log.Error("cannot restore the agent's credentials on a thread; it is discarded", "uid", u.UID)
			return false
		}
		return true
	})
	return err
}
