package agent

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
)

// sudo, without setuid. Every command in a sandbox runs with no_new_privs,
// so a setuid sudo can never raise a user to root; the agent, which forks
// every process, can. It listens on an abstract unix socket in the
// sandbox's network namespace (bound before any command runs, so nothing
// can squat the name), and a `sudo` client (templates/base/sudo) sends one
// request: the command, its environment and directory, the target user,
// and its own standard streams as descriptors. The kernel names the caller
// (SO_PEERCRED); a member of the sandbox's group `sudo` (or root) gets the
// command run as the target user, exactly as commands.run with that user
// would run it: the same spawning thread, no capabilities, no_new_privs,
// the sandbox's limits. Root inside gains nothing here that it does not
// have; a user gains the sandbox's root, which E2B's templates give `user`
// too (passwordless sudo).
//
// The protocol is JSON lines on a stream socket. Afterwards the client may
// send signal numbers, which go to the command's process group; when the
// client goes away the group is killed (a sudo killed takes its command
// with it). The reply is the exit status.

// SudoSocket is the abstract socket name ("@" is the leading NUL).
const SudoSocket = "@cage/sudo"

// sudoGroup is the group whose members may use sudo (Debian's).
const sudoGroup = "sudo"

const (
	maxSudoRequest  = 256 << 10 // argv and environment
	maxSudoSessions = 32        // at once; more wait in the kernel's backlog
	sudoReadTimeout = 10 * time.Second
)

type sudoRequest struct {
	Argv        []string `json:"argv"`
	Env         []string `json:"env"`         // the caller's, kept only with PreserveEnv
	PreserveEnv bool     `json:"preserveEnv"` // sudo -E
	Cwd         string   `json:"cwd"`
	User        string   `json:"user"` // "" is root
}

type sudoReply struct {
	Code   *int   `json:"code,omitempty"`
	Signal int    `json:"signal,omitempty"`
	Error  string `json:"error,omitempty"`
}

// serveSudo listens on name and serves sudo requests until the agent ends.
// A failure to listen is logged: the sandbox works, sudo does not. The
// socket is a stream: gVisor records SO_PEERCRED only for streams (a
// seqpacket peer would read as the agent itself).
func (s *Server) serveSudo(name string) {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: name, Net: "unix"})
	if err != nil {
		s.log.Warn("sudo: cannot listen", "socket", name, "err", err)
		return
	}
	slots := make(chan struct{}, maxSudoSessions)
	go func() {
		for {
			c, err := l.AcceptUnix()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					s.log.Warn("sudo: accept", "err", err)
					time.Sleep(100 * time.Millisecond)
					continue
				}
				return
			}
			slots <- struct{}{}
			go func() {
				defer func() { <-slots }()
				defer c.Close()
				s.sudoSession(c)
			}()
		}
	}()
}

// sudoSession serves one client connection: a request line (with the
// descriptors), then signal lines from the client, a reply line from the
// agent when the command ends.
func (s *Server) sudoSession(c *net.UnixConn) {
	reply := func(r sudoReply) {
		b, _ := json.Marshal(r)
		_, _ = c.Write(append(b, '\n'))
	}
	req, rest, fds, err := readSudoRequest(c)
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	if err != nil {
		reply(sudoReply{Error: err.Error()})
		return
	}
	caller, target, err := s.sudoAllowed(c, req.User)
	if err != nil {
		reply(sudoReply{Error: err.Error()})
		return
	}
	pid, exited, err := s.procs.sudoStart(req, target, fds, s.sudoEnv(req, caller, target))
	if err != nil {
		reply(sudoReply{Error: err.Error()})
		return
	}
	for _, fd := range fds {
		unix.Close(fd) // the command holds its own copies
	}
	fds = nil
	// Signals from the client go to the command's group; the client's
	// going kills it.
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		sc := bufio.NewScanner(io.MultiReader(bytes.NewReader(rest), c))
		sc.Buffer(make([]byte, 256), 256)
		for sc.Scan() {
			var m struct{ Signal int }
			if json.Unmarshal(sc.Bytes(), &m) == nil && m.Signal > 0 && m.Signal < 65 {
				_ = syscall.Kill(-pid, syscall.Signal(m.Signal))
			}
		}
		_ = syscall.Kill(-pid, syscall.SIGKILL) // the client left (or sent garbage)
	}()
	ws := <-exited
	if ws.Signaled() {
		reply(sudoReply{Signal: int(ws.Signal())})
	} else {
		code := ws.ExitStatus()
		reply(sudoReply{Code: &code})
	}
	_ = c.CloseWrite()
	select {
	case <-gone:
	case <-time.After(sudoReadTimeout):
	}
}

// readSudoRequest reads the request line, whose first bytes carry the three
// descriptors, and returns what was read past it.
func readSudoRequest(c *net.UnixConn) (req sudoRequest, rest []byte, fds []int, err error) {
	_ = c.SetReadDeadline(time.Now().Add(sudoReadTimeout))
	defer c.SetReadDeadline(time.Time{})
	buf := make([]byte, 0, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for first := true; ; first = false {
		if len(buf) == cap(buf) {
			if cap(buf) > maxSudoRequest {
				return req, nil, fds, fmt.Errorf("request larger than %d bytes", maxSudoRequest)
			}
			buf = append(buf[:cap(buf)], make([]byte, cap(buf))...)[:len(buf)]
		}
		var n int
		if first {
			// Descriptors come with the first bytes; later ones, read
			// without a control buffer, are closed by the kernel.
			var oobn, flags int
			n, oobn, flags, _, err = c.ReadMsgUnix(buf[len(buf):cap(buf)], oob)
			if cmsgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for _, m := range cmsgs {
					if got, perr := unix.ParseUnixRights(&m); perr == nil {
						fds = append(fds, got...)
					}
				}
			}
			if flags&unix.MSG_CTRUNC != 0 {
				return req, nil, fds, errors.New("too many descriptors")
			}
		} else {
			n, err = c.Read(buf[len(buf):cap(buf)])
		}
		buf = buf[:len(buf)+n]
		if i := bytes.IndexByte(buf, '\n'); i >= 0 {
			if i > maxSudoRequest {
				return req, nil, fds, fmt.Errorf("request larger than %d bytes", maxSudoRequest)
			}
			buf, rest = buf[:i], buf[i+1:]
			break
		}
		if err != nil {
			return req, nil, fds, fmt.Errorf("reading the request: %v", err)
		}
	}
	if len(fds) != 3 {
		return req, nil, fds, errors.New("the request must carry exactly three descriptors (stdin, stdout, stderr)")
	}
	if err := json.Unmarshal(buf, &req); err != nil {
		return req, nil, fds, fmt.Errorf("malformed request: %v", err)
	}
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return req, nil, fds, errors.New("no command")
	}
	for _, s := range append(append([]string{req.Cwd, req.User}, req.Argv...), req.Env...) {
		if strings.IndexByte(s, 0) >= 0 {
			return req, nil, fds, errors.New("a NUL byte in the request")
		}
	}
	return req, rest, fds, nil
}

// sudoAllowed names the caller (SO_PEERCRED) and, when the caller may use
// sudo (root, or a member of the group sudo), the user to run as.
func (s *Server) sudoAllowed(c *net.UnixConn, target string) (caller, u User, err error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return caller, u, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil || cerr != nil {
		return caller, u, fmt.Errorf("who is asking: %v", errors.Join(err, cerr))
	}
	passwd, _ := loadAccounts(s.cfg.Passwd)
	group, _ := loadAccounts(s.cfg.Group)
	name := passwd.name(cred.Uid)
	caller, err = passwd.lookup(name)
	if err != nil {
		caller = User{Name: name, UID: int(cred.Uid), GID: int(cred.Gid)}
	}
	if cred.Uid != 0 && (err != nil || !group.member(sudoGroup, name, uint32(caller.GID))) {
		return caller, u, fmt.Errorf("%s is not in the sudoers file (the group %q of this sandbox)", name, sudoGroup)
	}
	if target == "" {
		target = "root"
	}
	if u, err = s.lookupUser(target); err != nil {
		return caller, u, fmt.Errorf("unknown user %s", target)
	}
	return caller, u, nil
}

// sudoEnv is sudo's environment: the target's as commands.run gives it,
// the caller's terminal, SUDO_* naming the caller as the kernel does, and
// with -E (or VAR=value on the line) what the caller sent, but for who the
// target is.
func (s *Server) sudoEnv(req sudoRequest, caller, target User) []string {
	extra := map[string]string{}
	for _, kv := range req.Env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			continue
		}
		switch k {
		case "TERM", "COLORTERM", "DISPLAY":
			extra[k] = v
		case "HOME", "USER", "LOGNAME", "MAIL":
		default:
			if req.PreserveEnv {
				extra[k] = v
			}
		}
	}
	extra["SUDO_USER"] = caller.Name
	extra["SUDO_UID"] = strconv.Itoa(caller.UID)
	extra["SUDO_GID"] = strconv.Itoa(caller.GID)
	extra["SUDO_COMMAND"] = strings.Join(req.Argv, " ")
	return s.procs.commandEnv(target, extra)
}

// sudoStart starts a sudo command with the caller's descriptors and
// returns its pid and where its exit status arrives.
func (ps *processService) sudoStart(req sudoRequest, u User, fds []int, env []string) (int, <-chan syscall.WaitStatus, error) {
	bin, err := lookPath(req.Argv[0], env)
	if err != nil {
		return 0, nil, fmt.Errorf("%s: command not found", req.Argv[0])
	}
	dir := req.Cwd
	if !path.IsAbs(dir) {
		dir = u.Home
	}
	files := make([]uintptr, len(fds))
	for i, fd := range fds {
		files[i] = uintptr(fd)
	}
	attr := &syscall.ProcAttr{Dir: dir, Env: env, Files: files, Sys: &syscall.SysProcAttr{Setsid: true}}
	if u.UID != os.Getuid() || u.GID != os.Getgid() {
		attr.Sys.Credential = &syscall.Credential{Uid: uint32(u.UID), Gid: uint32(u.GID), Groups: []uint32{}}
	}
	exited := make(chan syscall.WaitStatus, 1)
	ps.mu.Lock()
	pid, err := ps.spawner.forkExec(bin, req.Argv, attr)
	if err == nil && ps.init {
		// Registered under ps.mu, which the reaper takes before it
		// looks a pid up: an exit at once is not missed.
		sudoWaiters.Lock()
		sudoWaiters.m[pid] = exited
		sudoWaiters.Unlock()
	}
	ps.mu.Unlock()
	if err != nil {
		var ce *connect.Error
		if err = startError(req.Argv[0], dir, err); errors.As(err, &ce) {
			err = errors.New(ce.Message())
		}
		return 0, nil, err
	}
	if !ps.init {
		go func() {
			var ws syscall.WaitStatus
			for {
				if _, err := syscall.Wait4(pid, &ws, 0, nil); err != syscall.EINTR {
					break
				}
			}
			exited <- ws
		}()
	}
	return pid, exited, nil
}

// sudoWaiters are the sudo commands the reaper (the agent as PID 1) hands
// exit statuses to, by pid.
var sudoWaiters = struct {
	sync.Mutex
	m map[int]chan syscall.WaitStatus
}{m: map[int]chan syscall.WaitStatus{}}

// sudoReaped delivers ws to the sudo command pid, if it is one.
func sudoReaped(pid int, ws syscall.WaitStatus) {
	sudoWaiters.Lock()
	ch := sudoWaiters.m[pid]
	delete(sudoWaiters.m, pid)
	sudoWaiters.Unlock()
	if ch != nil {
		ch <- ws
	}
}

// startSudo serves sudo on SudoSocket once, where the agent is the
// sandbox's PID 1 (in tests, serveSudo is called with a name of their own).
func (s *Server) startSudo() {
	if s.procs.init {
		sudoOnce.Do(func() { s.serveSudo(SudoSocket) })
	}
}

var sudoOnce sync.Once
