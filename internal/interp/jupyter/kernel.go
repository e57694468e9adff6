package jupyter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Options configure a kernel's process.
type Options struct {
	Cwd string   // its working directory ("": this process's)
	Env []string // its environment (nil: this process's)
	// StartTimeout bounds a start: launch to the first kernel_info reply
	// (default 2 minutes: a kernel under emulation is slow).
	StartTimeout time.Duration
}

// InterruptGrace is how long a run may go on after its interrupt before
// Execute gives up on it (ErrNotInterrupted).
var InterruptGrace = 3 * time.Second

var (
	// ErrNotInterrupted: the run went on after its interrupt.
	ErrNotInterrupted = errors.New("the run did not stop when interrupted")
	// ErrRestarted: the kernel was restarted (or closed) during the run.
	ErrRestarted = errors.New("the kernel was restarted during the run")
)

// Kernel is a kernel process this client launched, with its sockets.
type Kernel struct {
	spec    Spec
	opts    Options
	dir     string // private: the connection file and the IPC sockets
	sign    signer
	session string

	mu     sync.Mutex
	p      *proc // nil between a stop and the next start
	routes map[string]*route
}

// route receives the messages whose parent is one request.
type route struct {
	ch   chan *Message
	gone chan struct{}
}

// proc is one run of the kernel process and its sockets.
type proc struct {
	cmd     *exec.Cmd
	done    chan struct{} // closed when the process has exited
	waitErr error
	stopped atomic.Bool // ended by Restart or Close, not by itself
	out     *tail
	cancel  context.CancelFunc // the sockets' lifetime

	sendMu                sync.Mutex
	shell, control, iopub zmq4.Socket
}

// Start launches a kernel from spec and waits until it answers.
func Start(ctx context.Context, spec *Spec, opts Options) (*Kernel, error) {
	dir, err := os.MkdirTemp("", "cage-kernel-")
	if err != nil {
		return nil, err
	}
	var key [32]byte
	_, _ = rand.Read(key[:])
	if opts.StartTimeout == 0 {
		opts.StartTimeout = 2 * time.Minute
	}
	k := &Kernel{spec: *spec, opts: opts, dir: dir, sign: signer{key: []byte(hex.EncodeToString(key[:]))},
		session: newID(), routes: map[string]*route{}}
	if err := k.launch(ctx); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return k, nil
}

// endpoint is the IPC socket of a channel (the kernel binds "ip-port").
func (k *Kernel) endpoint(port int) string {
	return fmt.Sprintf("ipc://%s/k-%d", k.dir, port)
}

const (
	shellPort = iota + 1
	iopubPort
	stdinPort
	controlPort
	hbPort
)

func (k *Kernel) writeConnectionFile() (string, error) {
	for port := shellPort; port <= hbPort; port++ {
		_ = os.Remove(fmt.Sprintf("%s/k-%d", k.dir, port)) // a dead kernel's: it would take the next number
	}
	conn := map[string]any{"transport": "ipc", "ip": filepath.Join(k.dir, "k"),
		"shell_port": shellPort, "iopub_port": iopubPort, "stdin_port": stdinPort,
		"control_port": controlPort, "hb_port": hbPort, "key": string(k.sign.key),
		"signature_scheme": "hmac-sha256", "kernel_name": k.spec.Name}
	data, _ := json.Marshal(conn)
	path := filepath.Join(k.dir, "connection.json")
	return path, os.WriteFile(path, data, 0o600)
}

// launch starts the kernel process, connects its sockets and waits until
// it answers on both shell and IOPub.
func (k *Kernel) launch(ctx context.Context) error {
	ctx, cancelStart := context.WithTimeout(ctx, k.opts.StartTimeout)
	defer cancelStart()
	connFile, err := k.writeConnectionFile()
	if err != nil {
		return err
	}
	argv := make([]string, len(k.spec.Argv))
	for i, a := range k.spec.Argv {
		a = strings.ReplaceAll(a, "{connection_file}", connFile)
		argv[i] = strings.ReplaceAll(a, "{resource_dir}", k.spec.Dir)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = k.opts.Cwd
	cmd.Env = k.opts.Env
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	for name, v := range k.spec.Env {
		cmd.Env = append(cmd.Env, name+"="+v)
	}
	out := &tail{max: 4096}
	cmd.Stdout, cmd.Stderr = out, out
	// A group of its own (interrupts and kills reach what it started); it
	// dies with this server (a server started again knows nothing of it).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the %s kernel: %w", k.spec.Name, err)
	}
	sctx, cancel := context.WithCancel(context.Background())
	p := &proc{cmd: cmd, done: make(chan struct{}), out: out, cancel: cancel}
	go func() {
		p.waitErr = cmd.Wait()
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // what it started
		cancel()
		close(p.done)
	}()
	if err := k.connect(ctx, sctx, p); err != nil {
		k.kill(p)
		return err
	}
	k.mu.Lock()
	k.p = p
	k.mu.Unlock()
	if err := k.ready(ctx, p); err != nil {
		k.mu.Lock()
		k.p = nil
		k.mu.Unlock()
		k.kill(p)
		return err
	}
	return nil
}

// connect dials the shell, control and IOPub sockets (retrying until the
// kernel has bound them) and starts their readers.
func (k *Kernel) connect(ctx, sctx context.Context, p *proc) error {
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	opts := []zmq4.Option{quiet, zmq4.WithDialerRetry(10 * time.Millisecond), zmq4.WithDialerMaxRetries(-1)}
	p.shell = zmq4.NewDealer(sctx, opts...)
	p.control = zmq4.NewDealer(sctx, opts...)
	p.iopub = zmq4.NewSub(sctx, opts...)
	errs := make(chan error, 3)
	for _, s := range []struct {
		sock zmq4.Socket
		port int
	}{{p.shell, shellPort}, {p.control, controlPort}, {p.iopub, iopubPort}} {
		go func() { errs <- s.sock.Dial(k.endpoint(s.port)) }()
	}
	for range 3 {
		select {
		case err := <-errs:
			if err != nil {
				return k.startError(p, err)
			}
		case <-p.done:
			return k.startError(p, k.exitError(p))
		case <-ctx.Done():
			return k.startError(p, ctx.Err())
		}
	}
	if err := p.iopub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		return k.startError(p, err)
	}
	go k.read(p, p.shell, "shell")
	go k.read(p, p.control, "control")
	go k.read(p, p.iopub, "iopub")
	return nil
}

func (k *Kernel) startError(p *proc, err error) error {
	var exit *ExitError
	if errors.As(err, &exit) {
		return fmt.Errorf("the %s kernel did not start: %w", k.spec.Name, err)
	}
	msg := fmt.Sprintf("the %s kernel did not start: %v", k.spec.Name, err)
	if s := p.out.String(); s != "" {
		msg += ": " + s
	}
	return errors.New(msg)
}

// ready sends kernel_info_request until both its reply (shell) and a
// message it caused on IOPub arrive: a subscription takes a moment to
// reach the kernel, and IOPub messages sent before it are lost.
func (k *Kernel) ready(ctx context.Context, p *proc) error {
	for {
		id, r, err := k.request(p, p.shell, "kernel_info_request", struct{}{})
		if err != nil {
			return k.startError(p, err)
		}
		shell, iopub := false, false
		timer := time.NewTimer(time.Second)
	wait:
		for !shell || !iopub {
			select {
			case m := <-r.ch:
				shell = shell || m.Channel == "shell"
				iopub = iopub || m.Channel == "iopub"
			case <-timer.C:
				break wait
			case <-p.done:
				k.unregister(id)
				return k.startError(p, k.exitError(p))
			case <-ctx.Done():
				k.unregister(id)
				return k.startError(p, ctx.Err())
			}
		}
		timer.Stop()
		k.unregister(id)
		if shell && iopub {
			return nil
		}
	}
}

// read routes the messages of one socket to the requests they answer;
// messages that are not signed with the key, or answer nothing asked, are
// dropped.
func (k *Kernel) read(p *proc, sock zmq4.Socket, channel string) {
	for {
		raw, err := sock.Recv()
		if err != nil {
			select {
			case <-p.done:
				return
			case <-time.After(10 * time.Millisecond):
				continue
			}
		}
		m, err := k.sign.decode(raw.Frames)
		if err != nil {
			continue
		}
		m.Channel = channel
		k.mu.Lock()
		r := k.routes[m.Parent.MsgID]
		k.mu.Unlock()
		if r == nil {
			continue
		}
		select {
		case r.ch <- m:
		case <-r.gone:
		case <-p.done:
			return
		}
	}
}

// request sends a message on sock, its route registered first.
func (k *Kernel) request(p *proc, sock zmq4.Socket, msgType string, content any) (string, *route, error) {
	h := Header{MsgID: newID(), Session: k.session, Username: "cage", MsgType: msgType,
		Version: protocolVersion, Date: time.Now().UTC().Format(time.RFC3339Nano)}
	frames, err := k.sign.encode(h, content)
	if err != nil {
		return "", nil, err
	}
	r := &route{ch: make(chan *Message, 64), gone: make(chan struct{})}
	k.mu.Lock()
	k.routes[h.MsgID] = r
	k.mu.Unlock()
	p.sendMu.Lock()
	err = sock.SendMulti(zmq4.NewMsgFrom(frames...))
	p.sendMu.Unlock()
	if err != nil {
		k.unregister(h.MsgID)
		return "", nil, fmt.Errorf("send %s: %w", msgType, err)
	}
	return h.MsgID, r, nil
}

func (k *Kernel) unregister(id string) {
	k.mu.Lock()
	if r := k.routes[id]; r != nil {
		close(r.gone)
		delete(k.routes, id)
	}
	k.mu.Unlock()
}

// Reply is a kernel's execute_reply.
type Reply struct {
	Status         string   `json:"status"` // ok, error, or abort(ed)
	ExecutionCount int      `json:"execution_count"`
	EName          string   `json:"ename"`
	EValue         string   `json:"evalue"`
	Traceback      []string `json:"traceback"`
}

type executeRequest struct {
	Code            string         `json:"code"`
	Silent          bool           `json:"silent"`
	StoreHistory    bool           `json:"store_history"`
	UserExpressions map[string]any `json:"user_expressions"`
	AllowStdin      bool           `json:"allow_stdin"`
	StopOnError     bool           `json:"stop_on_error"`
}

// Execute runs code and hands h each IOPub message the run causes (other
// than status), in order, until the kernel is idle again. When ctx ends
// first, the kernel is interrupted and the run awaited for InterruptGrace.
// A silent run publishes no input or result and is not counted.
func (k *Kernel) Execute(ctx context.Context, code string, silent bool, h func(*Message)) (*Reply, error) {
	k.mu.Lock()
	p := k.p
	k.mu.Unlock()
	if p == nil {
		return nil, ErrRestarted
	}
	select {
	case <-p.done:
		return nil, k.exitError(p)
	default:
	}
	// Not stop_on_error: after an error ipykernel aborts the execute
	// requests that reach it before it has caught up, and the caller's
	// next run could be one; runs of a context are one at a time anyway.
	req := executeRequest{Code: code, Silent: silent, StoreHistory: !silent, UserExpressions: map[string]any{}}
	id, r, err := k.request(p, p.shell, "execute_request", req)
	if err != nil {
		return nil, err
	}
	defer k.unregister(id)
	var reply *Reply
	idle := false
	interrupt := ctx.Done()
	var grace <-chan time.Time
	for reply == nil || !idle {
		select {
		case m := <-r.ch:
			switch {
			case m.Channel == "shell" && m.Header.MsgType == "execute_reply":
				reply = &Reply{}
				if err := unmarshal(m.Content, reply); err != nil {
					return nil, fmt.Errorf("execute_reply: %w", err)
				}
			case m.Channel == "iopub" && m.Header.MsgType == "status":
				var st struct {
					State string `json:"execution_state"`
				}
				_ = unmarshal(m.Content, &st)
				idle = idle || st.State == "idle"
			case m.Channel == "iopub":
				h(m)
			}
		case <-p.done:
			return reply, k.exitError(p)
		case <-interrupt:
			interrupt = nil
			_ = k.Interrupt()
			grace = time.After(InterruptGrace)
		case <-grace:
			return nil, ErrNotInterrupted
		}
	}
	return reply, nil
}

// Interrupt interrupts what the kernel runs: SIGINT to its process group,
// or interrupt_request where its kernelspec asks for messages.
func (k *Kernel) Interrupt() error {
	k.mu.Lock()
	p := k.p
	k.mu.Unlock()
	if p == nil {
		return nil
	}
	if k.spec.InterruptMode == "message" {
		id, _, err := k.request(p, p.control, "interrupt_request", struct{}{})
		if err == nil {
			time.AfterFunc(InterruptGrace, func() { k.unregister(id) })
		}
		return err
	}
	return syscall.Kill(-p.cmd.Process.Pid, syscall.SIGINT)
}

// Restart ends the kernel process (its state is lost) and starts it again
// with the same connection; a run in progress ends with ErrRestarted.
func (k *Kernel) Restart(ctx context.Context) error {
	k.mu.Lock()
	p := k.p
	k.p = nil
	k.mu.Unlock()
	if p != nil {
		k.kill(p)
	}
	return k.launch(ctx)
}

// Close ends the kernel and removes its files.
func (k *Kernel) Close() error {
	k.mu.Lock()
	p := k.p
	k.p = nil
	k.mu.Unlock()
	if p != nil {
		k.kill(p)
	}
	return os.RemoveAll(k.dir)
}
