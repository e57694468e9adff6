package spawner

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/cgroups"
)

// FD is the descriptor the spawner is given its socket on.
const FD = 3

// Arg is cage-agent's argument for the spawner.
const Arg = "spawner"

// Serve is the spawner: it starts what the daemon at the other end of fd
// asks for until that end closes. It returns nil when the daemon hung up.
func Serve(fd int) error {
	// It ends with the daemon: when the daemon's end of the socket closes
	// (nothing else can ask it anything), recv reads the end of it. The
	// socket never reaches a child, nor does anything the spawner inherited.
	unix.CloseOnExec(fd)
	if err := unix.CloseRange(uint(fd+1), math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("inherited descriptors: %w", err)
	}
	s := &server{fd: fd, managers: map[string]*cgroups.Manager{}, born: make(chan struct{}, 1)}
	go s.reap()
	rc := newReceiver()
	for {
		var req Request
		files, err := rc.recv(fd, &req)
		if errors.Is(err, errClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		go s.start(&req, files)
	}
}

type server struct {
	fd int
	// out serialises replies on the socket (requests are served at once).
	out      sync.Mutex
	mu       sync.Mutex
	managers map[string]*cgroups.Manager // by cgroup parent
	// forking is held (read) from a fork until its answer is sent; the
	// reaper holds it (write) to reap and report, so no child is reaped
	// before its pidfd exists, its end is reported after its answer, and
	// a child that reuses its pid is answered after that end.
	forking sync.RWMutex
	born    chan struct{} // a child was forked (wakes a reaper with none)
}

func (s *server) reply(r reply) {
	s.out.Lock()
	defer s.out.Unlock()
	_ = send(s.fd, r, nil)
}

// start forks the request's process, answers, and reports its end.
func (s *server) start(req *Request, files []int) {
	defer closeAll(files)
	s.forking.RLock()
	defer s.forking.RUnlock()
	pid, err := s.fork(req, files)
	if err == nil {
		select {
		case s.born <- struct{}{}:
		default:
		}
	}
	if err != nil {
		r := reply{ID: req.ID, Err: err.Error()}
		var errno syscall.Errno
		if errors.As(err, &errno) {
			r.Errno = int(errno)
		}
		s.reply(r)
		return
	}
	// The child is not reaped before its pidfd exists: the daemon's pidfd
	// (made from the pid in the reply) names this child, never a reuse.
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		_ = unix.Kill(pid, unix.SIGKILL) // reaped by reap
		s.reply(reply{ID: req.ID, Err: fmt.Sprintf("pidfd: %v", err)})
		return
	}
	s.out.Lock()
	_ = send(s.fd, reply{ID: req.ID, PID: pid}, []int{pidfd})
	s.out.Unlock()
	unix.Close(pidfd)
}

// reap reaps every child as it ends and reports it: one thread for them
// all (a thread per child held a thousand of them with a thousand
// sandboxes alive, and made every fork copy their stacks' mappings).
func (s *server) reap() {
	for {
		var info unix.Siginfo
		// Wait without reaping: the child stays a zombie, its pid not
		// reused, until it is reaped below under forking.
		err := unix.Waitid(unix.P_ALL, 0, &info, unix.WEXITED|unix.WNOWAIT, nil)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.ECHILD):
			<-s.born
			continue
		case err != nil:
			return
		}
		pid := int((*childInfo)(unsafe.Pointer(&info)).pid)
		// The end is reported before the lock is let go: a fork that
		// reuses the pid answers only after it, so the daemon never
		// takes the old child's end for the new one's.
		s.forking.Lock()
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		if err == nil && got == pid {
			s.reply(reply{Exit: pid, Status: uint32(ws)})
		}
		s.forking.Unlock()
	}
}

// childInfo is the head of a siginfo_t of SIGCHLD (si_pid follows the
// three ints and the padding of the union's alignment on 64-bit Linux).
type childInfo struct {
	signo, errno, code, _ int32
	pid                   int32
}

// fork starts the process in its cgroups.
func (s *server) fork(req *Request, files []int) (int, error) {
	if len(files) != req.Files || req.Files < 3 {
		return 0, fmt.Errorf("spawner: %d descriptors for a request of %d", len(files), req.Files)
	}
	if req.Path == "" || len(req.Argv) == 0 {
		return 0, errors.New("spawner: no program")
	}
	attr := &syscall.ProcAttr{
		Dir:   req.Dir,
		Env:   req.Env,
		Files: make([]uintptr, len(files)),
		Sys: &syscall.SysProcAttr{
			Cloneflags:                 req.Cloneflags,
			UidMappings:                req.UIDMaps,
			GidMappings:                req.GIDMaps,
			GidMappingsEnableSetgroups: req.Setgroups,
			Setsid:                     req.Setsid,
		},
	}
	if len(req.UIDMaps) > 0 {
		attr.Sys.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	}
	for i, fd := range files {
		attr.Files[i] = uintptr(fd)
	}
	start := func(cgroupFD int) (int, error) {
		attr.Sys.UseCgroupFD, attr.Sys.CgroupFD = cgroupFD >= 0, cgroupFD
		fork := func() (int, error) { return CloneExec(req.Path, req.Argv, attr) }
		var pid int
		var err error
		if uid, gid, ok := ownerOf(req); ok {
			// A new user namespace is its root's host uid's, not root's
			// (ForkOwned).
			pid, err = ForkOwned(uid, gid, fork)
		} else {
			pid, err = fork()
		}
		if err == nil && req.Nice != 0 {
			_ = unix.Setpriority(unix.PRIO_PROCESS, pid, req.Nice)
		}
		return pid, err
	}
	if req.Cgroup == "" {
		return start(-1)
	}
	if strings.ContainsAny(req.Cgroup, "/\x00") || req.Cgroup == "." || req.Cgroup == ".." {
		return 0, fmt.Errorf("spawner: bad cgroup name %q", req.Cgroup)
	}
	m, err := s.manager(req.CgroupParent)
	if err != nil {
		return 0, err
	}
	return m.Open(req.Cgroup).Spawn(start)
}

// ownerOf is the host uid and gid that root of a request's new user
// namespace maps to, which own the namespace (ok false: no new user
// namespace, or none mapped to root).
func ownerOf(req *Request) (uid, gid int, ok bool) {
	if req.Cloneflags&syscall.CLONE_NEWUSER == 0 {
		return 0, 0, false
	}
	uid, gid = -1, -1
	for _, m := range req.UIDMaps {
		if m.ContainerID == 0 {
			uid = m.HostID
		}
	}
	for _, m := range req.GIDMaps {
		if m.ContainerID == 0 {
			gid = m.HostID
		}
	}
	return uid, gid, uid > 0 && gid > 0
}

// manager is the cgroup layout under parent, read once.
func (s *server) manager(parent string) (*cgroups.Manager, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if m := s.managers[parent]; m != nil {
		return m, nil
	}
	m, err := cgroups.Detect(parent)
	if err != nil {
		return nil, err
	}
	s.managers[parent] = m
	return m, nil
}
