package spawner

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// CloneExec starts path as syscall.ForkExec(path, argv, attr) does, for
// what cage's walls ask of it to start an agent in new namespaces (a user
// namespace among them, its id maps, a cgroup, setsid, the parent-death
// signal, credentials 0:0), without copying the caller's address space.
// Go's ForkExec cannot vfork when it makes a user namespace (the child
// waits for its parent to write the id maps, and a vforked parent waits
// for its child), so it forks: it copies the page tables of the caller
// (cage run's whole CLI, 7 ms of its run on these machines) and write-
// protects its memory, which both then fault on. Here the child shares
// the caller's memory (CLONE_VM) on a stack of its own and runs only a
// list of system calls (rawClone3, in assembly: no Go code runs in it);
// this thread writes its id maps meanwhile and lets it go on to exec.
//
// Anything else attr asks for is left to syscall.ForkExec.
func CloneExec(path string, argv []string, attr *syscall.ProcAttr) (int, error) {
	if !cloneExecCan(attr) {
		return syscall.ForkExec(path, argv, attr)
	}
	pid, err := cloneExec(path, argv, attr)
	if errors.Is(err, errNoClone3) {
		// A kernel before 5.3, or one that refuses this clone3 (its
		// arguments' size, CLONE_VM with these namespaces): Go's fork,
		// which says what it finds.
		return syscall.ForkExec(path, argv, attr)
	}
	return pid, err
}

// errNoClone3 is clone3 refused as such (ENOSYS, EINVAL, E2BIG).
var errNoClone3 = errors.New("clone3 refused")

// cloneExecCan reports whether cloneExec does all that attr asks.
func cloneExecCan(attr *syscall.ProcAttr) bool {
	sys := attr.Sys
	if sys == nil || sys.Cloneflags&unix.CLONE_NEWUSER == 0 || sys.Unshareflags != 0 || sys.Chroot != "" ||
		sys.Ptrace || sys.Setpgid || sys.Setctty || sys.Noctty || sys.Foreground || sys.PidFD != nil ||
		len(sys.AmbientCaps) > 0 || sys.Cloneflags&(unix.CLONE_VM|unix.CLONE_VFORK|unix.CLONE_THREAD|unix.CLONE_FILES|unix.CLONE_SIGHAND|unix.CLONE_FS|unix.CLONE_PARENT|unix.CLONE_PIDFD|unix.CLONE_SETTLS) != 0 {
		return false
	}
	if c := sys.Credential; c != nil && (len(c.Groups) > 0 || c.NoSetGroups) {
		return false
	}
	for _, f := range attr.Files {
		if int(f) < 0 {
			return false
		}
	}
	return true
}

// op is one system call of the child's: its number, arguments and the
// result it must return (-1: any that is not an error).
type op struct {
	nr   uintptr
	a    [6]uintptr
	want int64
}

// childProg is what rawClone3's child runs (layout: see the assembly).
type childProg struct {
	ops    *op
	n      uintptr
	errFD  uintptr
	report [2]uint64 // the child's {index, errno}, written there first
}

// cloneArgs is the kernel's struct clone_args (to cgroup: 88 bytes).
type cloneArgs struct {
	flags, pidfd, childTID, parentTID, exitSignal, stack, stackSize, tls, setTID, setTIDSize, cgroup uint64
}

func rawClone3(args unsafe.Pointer, size uintptr, prog unsafe.Pointer) (pid uintptr, errno uintptr)

// kernelSigaction is the kernel's struct sigaction on amd64; zero is
// SIG_DFL.
type kernelSigaction struct {
	handler, flags, restorer uintptr
	mask                     uint64
}

func cloneExec(path string, argv []string, attr *syscall.ProcAttr) (pid int, err error) {
	sys := attr.Sys
	pathp, err := syscall.BytePtrFromString(path)
	if err != nil {
		return 0, err
	}
	argvp, err := syscall.SlicePtrFromStrings(argv)
	if err != nil {
		return 0, err
	}
	envp, err := syscall.SlicePtrFromStrings(attr.Env)
	if err != nil {
		return 0, err
	}
	var dirp *byte
	if attr.Dir != "" {
		if dirp, err = syscall.BytePtrFromString(attr.Dir); err != nil {
			return 0, err
		}
	}
	var uidMap, gidMap []byte
	for _, m := range sys.UidMappings {
		uidMap = fmt.Appendf(uidMap, "%d %d %d\n", m.ContainerID, m.HostID, m.Size)
	}
	for _, m := range sys.GidMappings {
		gidMap = fmt.Appendf(gidMap, "%d %d %d\n", m.ContainerID, m.HostID, m.Size)
	}

	// The descriptors the child needs: a pipe it waits on for its maps,
	// one it reports a failure on, and each of attr.Files, all above the
	// numbers it dups attr.Files onto (dup3 then never closes one it
	// still needs), all close-on-exec. Made under ForkLock, as
	// syscall.ForkExec's are, so that no other fork takes them along.
	n := len(attr.Files)
	var toClose []int
	defer func() {
		for _, fd := range toClose {
			unix.Close(fd)
		}
	}()
	above := func(fd int) (int, error) {
		hi, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, n)
		if err == nil {
			toClose = append(toClose, hi)
		}
		return hi, err
	}
	syscall.ForkLock.Lock()
	locked := true
	defer func() {
		if locked {
			syscall.ForkLock.Unlock()
		}
	}()
	var syncp, errp [2]int
	if err := unix.Pipe2(syncp[:], unix.O_CLOEXEC); err != nil {
		return 0, err
	}
	toClose = append(toClose, syncp[0])
	syncW := os.NewFile(uintptr(syncp[1]), "sync")
	defer syncW.Close()
	if err := unix.Pipe2(errp[:], unix.O_CLOEXEC); err != nil {
		return 0, err
	}
	toClose = append(toClose, errp[1])
	errR := os.NewFile(uintptr(errp[0]), "report")
	defer errR.Close()
	childSync, err := above(syncp[0])
	if err != nil {
		return 0, err
	}
	childErr, err := above(errp[1])
	if err != nil {
		return 0, err
	}
	srcs := make([]int, n)
	for i, f := range attr.Files {
		if srcs[i], err = above(int(f)); err != nil {
			return 0, err
		}
	}

	// The child's system calls, in order; execve last.
	var buf [1]byte
	var dfl kernelSigaction
	var empty uint64
	ops := []op{{nr: unix.SYS_READ, a: [6]uintptr{uintptr(childSync), uintptr(unsafe.Pointer(&buf[0])), 1}, want: 1}}
	names := []string{"wait for the id maps"}
	add := func(name string, nr uintptr, a ...uintptr) {
		o := op{nr: nr, want: -1}
		copy(o.a[:], a)
		ops, names = append(ops, o), append(names, name)
	}
	if c := sys.Credential; c != nil {
		// As syscall.ForkExec: not where setgroups is denied (no groups
		// are asked for here).
		if !(sys.GidMappings != nil && !sys.GidMappingsEnableSetgroups) {
			add("setgroups", unix.SYS_SETGROUPS, 0, 0)
		}
		add("setgid", unix.SYS_SETGID, uintptr(c.Gid))
		add("setuid", unix.SYS_SETUID, uintptr(c.Uid))
	}
	if sys.Setsid {
		add("setsid", unix.SYS_SETSID)
	}
	if sys.Pdeathsig != 0 {
		add("parent-death signal", unix.SYS_PRCTL, unix.PR_SET_PDEATHSIG, uintptr(sys.Pdeathsig))
	}
	for i, fd := range srcs {
		add("descriptor "+strconv.Itoa(i), unix.SYS_DUP3, uintptr(fd), uintptr(i), 0)
	}
	if dirp != nil {
		add("chdir", unix.SYS_CHDIR, uintptr(unsafe.Pointer(dirp)))
	}
	// The caller's signal handlers are its own: back to the defaults,
	// then unblocked. What the caller ignores stays ignored, as
	// syscall.ForkExec leaves it (execve keeps it, and the mask).
	for sig := 1; sig <= 64; sig++ {
		var cur kernelSigaction
		if _, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), 0, uintptr(unsafe.Pointer(&cur)), 8, 0, 0); e == 0 && cur.handler == 1 { // SIG_IGN
			continue
		}
		if sig != int(unix.SIGKILL) && sig != int(unix.SIGSTOP) {
			add("signal "+strconv.Itoa(sig), unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(&dfl)), 0, 8)
		}
	}
	add("signal mask", unix.SYS_RT_SIGPROCMASK, unix.SIG_SETMASK, uintptr(unsafe.Pointer(&empty)), 0, 8)
	add("exec", unix.SYS_EXECVE, uintptr(unsafe.Pointer(pathp)), uintptr(unsafe.Pointer(&argvp[0])), uintptr(unsafe.Pointer(&envp[0])))
	prog := &childProg{ops: &ops[0], n: uintptr(len(ops)), errFD: uintptr(childErr)}

	stack := make([]byte, 16<<10)
	args := &cloneArgs{
		flags:      uint64(sys.Cloneflags) | unix.CLONE_VM,
		exitSignal: uint64(unix.SIGCHLD),
		stack:      uint64(uintptr(unsafe.Pointer(&stack[0]))),
		stackSize:  uint64(len(stack)),
	}
	if sys.UseCgroupFD {
		args.flags |= unix.CLONE_INTO_CGROUP
		args.cgroup = uint64(sys.CgroupFD)
	}

	// The child starts with every signal blocked: the handlers it shares
	// with this process until its exec are Go's, which must never run on
	// its stack.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var all, old unix.Sigset_t
	for i := range all.Val {
		all.Val[i] = ^uint64(0)
	}
	if err := unix.PthreadSigmask(unix.SIG_SETMASK, &all, &old); err != nil {
		return 0, err
	}
	r, errno := rawClone3(unsafe.Pointer(args), unsafe.Sizeof(*args), unsafe.Pointer(prog))
	_ = unix.PthreadSigmask(unix.SIG_SETMASK, &old, nil)
	syscall.ForkLock.Unlock()
	locked = false
	switch syscall.Errno(errno) {
	case syscall.ENOSYS, syscall.EINVAL, syscall.E2BIG:
		return 0, fmt.Errorf("%w: %w", errNoClone3, syscall.Errno(errno))
	}
	if errno != 0 {
		return 0, syscall.Errno(errno)
	}
	pid = int(r)
	// The child's copies stay with it: close this process's.
	for _, fd := range toClose {
		unix.Close(fd)
	}
	toClose = nil

	reap := func() {
		var ws unix.WaitStatus
		for {
			if _, e := unix.Wait4(pid, &ws, 0, nil); e != unix.EINTR {
				return
			}
		}
	}
	fail := func(err error) (int, error) {
		_ = unix.Kill(pid, unix.SIGKILL)
		syncW.Close()
		reap()
		return 0, err
	}
	if err := writeMaps(pid, uidMap, gidMap, sys.GidMappings != nil && !sys.GidMappingsEnableSetgroups); err != nil {
		return fail(err)
	}
	if _, err := syncW.Write([]byte{0}); err != nil {
		return fail(fmt.Errorf("start the child: %w", err))
	}
	syncW.Close()
	// Its report, or the end of the pipe at its exec (close-on-exec).
	var rep [16]byte
	got, err := readFull(errR, rep[:])
	runtime.KeepAlive(stack)
	runtime.KeepAlive(ops)
	runtime.KeepAlive(prog)
	runtime.KeepAlive(argvp)
	runtime.KeepAlive(envp)
	runtime.KeepAlive(pathp)
	runtime.KeepAlive(dirp)
	runtime.KeepAlive(&buf)
	runtime.KeepAlive(&dfl)
	runtime.KeepAlive(&empty)
	if err != nil {
		return fail(fmt.Errorf("the child's report: %w", err))
	}
	if got == 0 {
		return pid, nil
	}
	idx := *(*uint64)(unsafe.Pointer(&rep[0]))
	e := syscall.Errno(*(*uint64)(unsafe.Pointer(&rep[8])))
	reap()
	if idx == uint64(len(ops)-1) {
		return 0, e // exec's own error, as syscall.ForkExec gives it
	}
	if idx < uint64(len(names)) {
		return 0, fmt.Errorf("%s: %w", names[idx], e)
	}
	return 0, e
}

// writeMaps writes the child's id maps (and denies setgroups first when
// asked).
func writeMaps(pid int, uidMap, gidMap []byte, denySetgroups bool) error {
	proc := "/proc/" + strconv.Itoa(pid) + "/"
	write := func(name string, b []byte) error {
		if len(b) == 0 {
			return nil
		}
		f, err := os.OpenFile(proc+name, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = f.Write(b)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("write %s: %w", strings.TrimPrefix(name, proc), err)
		}
		return nil
	}
	if err := write("uid_map", uidMap); err != nil {
		return err
	}
	if denySetgroups {
		if err := write("setgroups", []byte("deny")); err != nil {
			return err
		}
	}
	return write("gid_map", gidMap)
}

// readFull reads len(b) bytes, or nothing at the end of the pipe.
func readFull(f *os.File, b []byte) (int, error) {
	got := 0
	for got < len(b) {
		n, err := f.Read(b[got:])
		got += n
		if err != nil {
			if got == 0 && errors.Is(err, io.EOF) {
				return 0, nil
			}
			return got, err
		}
	}
	return got, nil
}
