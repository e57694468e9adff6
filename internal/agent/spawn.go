package agent

import (
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"os"
	"os/signal"
	"path"
	"sync"
	"syscall"
	"time"

	tracing "github.com/cagehq/cage/internal/trace"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	pb "github.com/cagehq/cage/api/gen/process"
)

// start launches the process a Start request describes and returns it with
// a subscription that sees its output from the first byte.
func (ps *processService) start(req *pb.StartRequest, user User) (*proc, *sub, error) {
	return ps.startOn(req, user, nil)
}

// startOn is start on the given stdin, stdout and stderr (a one-shot
// run's), which it closes once the process has them, or on its own
// pipes (nil).
func (ps *processService) startOn(req *pb.StartRequest, user User, given []*os.File) (*proc, *sub, error) {
	cfg := req.GetProcess()
	if cfg == nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process config is required"))
	}
	env := ps.commandEnv(user, cfg.GetEnvs())
	bin, err := lookPath(cfg.GetCmd(), env)
	if err != nil {
		return nil, nil, err
	}
	dir := user.Home
	if cfg.Cwd != nil && cfg.GetCwd() != "" {
		dir = cfg.GetCwd()
		if !path.IsAbs(dir) {
			dir = path.Join(user.Home, dir)
		}
	}
	maxOut := ps.s.cfg.MaxOutput
	if m := int64(req.GetMaxOutputBytes()); m > 0 && m < maxOut {
		maxOut = m
	}
	p := newProc(cfg, req.GetTag(), maxOut)
	s := p.subscribe()

	var files []uintptr
	var parentEnds, pumps []*os.File
	if given != nil {
		files, parentEnds = []uintptr{given[0].Fd(), given[1].Fd(), given[2].Fd()}, given
	} else if files, parentEnds, pumps, err = ps.stdio(p, req); err != nil {
		return nil, nil, err
	}
	attr := &syscall.ProcAttr{
		Dir:   dir,
		Env:   env,
		Files: files,
		Sys:   &syscall.SysProcAttr{Setsid: true},
	}
	if p.pty != nil {
		attr.Sys.Setctty = true
		attr.Sys.Ctty = 0
	}
	if user.UID != os.Getuid() || user.GID != os.Getgid() {
		attr.Sys.Credential = &syscall.Credential{Uid: uint32(user.UID), Gid: uint32(user.GID), Groups: []uint32{}}
	}
	if lim := ps.s.cfg.Limits; lim != nil {
		p.oomBase, p.pidsBase = lim.OOMKills(), lim.PidsMax()
	}
	argv := append([]string{cfg.GetCmd()}, cfg.GetArgs()...)

	trace("agent: fork")
	ps.mu.Lock()
	pid, err := ps.spawner.forkExec(bin, argv, attr)
	if err == nil {
		p.pid = pid
		ps.table[pid] = p
	}
	ps.mu.Unlock()
	for _, f := range parentEnds {
		f.Close() // the child's ends; the child holds its own copies
	}
	if err != nil {
		for _, f := range pumps {
			f.Close()
		}
		if p.stdin != nil {
			p.stdin.Close()
		}
		return nil, nil, startError(cfg.GetCmd(), dir, err)
	}
	if !ps.init {
		go func() {
			var ws syscall.WaitStatus
			for {
				_, err := syscall.Wait4(pid, &ws, 0, nil)
				if err != syscall.EINTR {
					break
				}
			}
			p.exited <- ws
		}()
	}
	if ms := req.GetTimeoutMs(); ms > 0 {
		t := time.AfterFunc(time.Duration(ms)*time.Millisecond, func() {
			p.mu.Lock()
			p.timedOut = true
			p.mu.Unlock()
			_ = p.signal(syscall.SIGKILL)
		})
		go func() { <-p.done; t.Stop() }()
	}
	go ps.supervise(p, pumps)
	return p, s, nil
}

// stdio makes the process's stdin/stdout/stderr: a PTY when asked, else
// pipes (and /dev/null for stdin unless the request wants to send input).
// It returns the child's files, the parent's copies of them to close after
// fork, and the output ends to pump.
func (ps *processService) stdio(p *proc, req *pb.StartRequest) (files []uintptr, childEnds, pumps []*os.File, err error) {
	if req.Pty != nil {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, nil, nil, connect.NewError(connect.CodeInternal, fmt.Errorf("open pty: %w", err))
		}
		if size := req.GetPty().GetSize(); size != nil && size.Rows > 0 && size.Cols > 0 {
			_ = pty.Setsize(master, &pty.Winsize{Rows: uint16(size.Rows), Cols: uint16(size.Cols)})
		}
		p.pty = master
		fd := slave.Fd()
		return []uintptr{fd, fd, fd}, []*os.File{slave}, []*os.File{master}, nil
	}
	var closeOnErr []*os.File
	defer func() {
		if err != nil {
			for _, f := range closeOnErr {
				f.Close()
			}
		}
	}()
	var stdin *os.File
	if req.GetStdin() {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		closeOnErr = append(closeOnErr, r, w)
		stdin, p.stdin = r, w
	} else {
		stdin, err = os.Open(os.DevNull)
		if err != nil {
			return nil, nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		closeOnErr = append(closeOnErr, stdin)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, nil, nil, connect.NewError(connect.CodeInternal, err)
	}
	closeOnErr = append(closeOnErr, outR, outW)
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, nil, nil, connect.NewError(connect.CodeInternal, err)
	}
	widenPipe(outR)
	widenPipe(errR)
	return []uintptr{stdin.Fd(), outW.Fd(), errW.Fd()}, []*os.File{stdin, outW, errW}, []*os.File{outR, errR}, nil
}

// outputPipeSize is the buffer asked for a command's stdout and stderr
// pipes (the kernel's default is 64 KiB): a command writing much in small
// writes then wakes the agent once per many writes, not at each. Under
// gVisor each wake-up is a switch between the sentry's threads: 1 GiB of
// `head -c` through the agent took 32-34 s with 64 KiB, 21-24 s with 256
// KiB, 18-23 s with 1 MiB (docs/BENCHMARKS.md). Not 1 MiB: an unprivileged
// user's pipes past fs.pipe-user-pages-soft (64 MiB of buffers, counted as
// asked, not as used) are made with 8 KiB, and on the process wall and
// runc the agent's pipes are its user's; at 256 KiB a sandbox runs 128
// commands at once before that. Where the kernel refuses, the pipe keeps
// its size.
const outputPipeSize = 256 << 10

func widenPipe(r *os.File) {
	if c, err := r.SyscallConn(); err == nil {
		_ = c.Control(func(fd uintptr) { _, _ = unix.FcntlInt(fd, unix.F_SETPIPE_SZ, outputPipeSize) })
	}
}

// startError maps a failed fork/exec to what a caller can act on: a missing
// command is not_found (cage run turns it into exit code 127).
func startError(cmd, dir string, err error) error {
	switch {
	case errors.Is(err, syscall.ENOENT):
		if _, statErr := os.Stat(dir); statErr != nil {
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("working directory %s does not exist", dir))
		}
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("%s: command not found", cmd))
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return connect.NewError(connect.CodePermissionDenied, fmt.Errorf("%s: permission denied", cmd))
	case errors.Is(err, syscall.EAGAIN):
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%s: cannot fork: process limit reached", cmd))
	case errors.Is(err, syscall.ENOEXEC):
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: exec format error", cmd))
	}
	return connect.NewError(connect.CodeInternal, fmt.Errorf("start %s: %v", cmd, err))
}

// supervise pumps output, waits for the exit, and publishes the end event.
func (ps *processService) supervise(p *proc, pumps []*os.File) {
	var wg sync.WaitGroup
	exitedAt := make(chan struct{})
	kinds := []int{outStdout, outStderr}
	if p.pty != nil {
		kinds = []int{outPTY}
	}
	for i, f := range pumps {
		wg.Add(1)
		go p.pump(f, kinds[i], &wg, exitedAt)
	}
	trace("agent: forked")
	ws := <-p.exited
	trace("agent: exited")
	close(exitedAt)
	wg.Wait()
	trace("agent: drained")
	p.inputMu.Lock()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	p.inputMu.Unlock()
	p.finish(ps.endEvent(p, ws))
	ps.mu.Lock()
	delete(ps.table, p.pid)
	ps.mu.Unlock()
}

// endEvent describes how the process ended. The reason comes from the host's
// cgroup counters where they are visible; they only ever explain a death, they
// never decide one.
func (ps *processService) endEvent(p *proc, ws syscall.WaitStatus) *pb.ProcessEvent_EndEvent {
	end := &pb.ProcessEvent_EndEvent{}
	oom, pids := false, false
	if lim := ps.s.cfg.Limits; lim != nil {
		oom = lim.OOMKills() > p.oomBase
		pids = lim.PidsMax() > p.pidsBase
	}
	p.mu.Lock()
	timedOut := p.timedOut
	p.mu.Unlock()
	switch {
	case ws.Exited():
		end.Exited = true
		end.ExitCode = int32(ws.ExitStatus())
		end.Status = fmt.Sprintf("exit status %d", ws.ExitStatus())
		end.Reason = "exited"
		if pids && ws.ExitStatus() != 0 {
			end.Reason = "pids_limit"
		}
	case ws.Signaled():
		end.ExitCode = -1
		end.Status = "signal: " + ws.Signal().String()
		end.Reason = "signal"
		if ws.Signal() == syscall.SIGKILL && oom {
			end.Reason = "oom"
		}
	}
	if timedOut {
		end.Reason = "timeout"
	}
	if msg := reasonMessage(end.Reason); msg != "" {
		end.Error = &msg
	}
	return end
}

func reasonMessage(reason string) string {
	switch reason {
	case "oom":
		return "killed: out of memory (the sandbox's memory limit)"
	case "pids_limit":
		return "failed: the sandbox's process limit was reached"
	case "timeout":
		return "killed: the command's timeout expired"
	}
	return ""
}

// reapLoop runs when the agent is PID 1: it reaps every child, delivering
// the status of processes the agent started and discarding orphans'.
func (ps *processService) reapLoop() {
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	for {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if err == syscall.EINTR {
				continue
			}
			if pid <= 0 || err != nil {
				break
			}
			ps.mu.Lock()
			p := ps.table[pid]
			ps.mu.Unlock()
			if p != nil {
				p.exited <- ws
			} else {
				sudoReaped(pid, ws)
			}
		}
		<-sigs
	}
}

func trace(what string) { tracing.Mark(what) }
