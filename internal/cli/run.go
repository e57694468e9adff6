package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/term"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/trace"
	"github.com/cagehq/cage/internal/units"
	"github.com/cagehq/cage/internal/wall"
)

type runFlags struct {
	wall, template, memory, disk, shm, timeout, workdir, user, maxOutput string
	cpus                                                                 float64
	pids                                                                 int64
	env, copyIn                                                          []string
	pty                                                                  string
	net                                                                  netFlags
}

// netFlags are --net, --allow and --deny.
type netFlags struct {
	mode        string
	allow, deny []string
}

func (n *netFlags) add(fl *pflag.FlagSet) {
	fl.StringVar(&n.mode, "net", "", "network: none (loopback only; the default), internet (the public internet), allowlist (only --allow)")
	fl.StringArrayVar(&n.allow, "allow", nil, "let the sandbox reach NAME_OR_CIDR[:PORT], e.g. pypi.org, *.github.com:443, 1.2.3.0/24 (repeatable; implies --net allowlist)")
	fl.StringArrayVar(&n.deny, "deny", nil, "with --net internet: keep the sandbox from NAME_OR_CIDR[:PORT] (repeatable)")
}

// policy is the network policy the flags ask for.
func (n *netFlags) policy() (network.Policy, error) {
	var p network.Policy
	if n.mode != "" {
		m, err := network.ParseMode(n.mode)
		if err != nil {
			return p, exitf(ExitUsage, "--net %q: want none, internet or allowlist", n.mode)
		}
		p.Mode = m
	} else if len(n.allow) > 0 {
		p.Mode = network.Allowlist
	}
	for _, list := range []struct {
		flag  string
		in    []string
		rules *[]network.Rule
	}{{"--allow", n.allow, &p.Allow}, {"--deny", n.deny, &p.Deny}} {
		for _, s := range list.in {
			r, err := network.ParseRule(s)
			if err != nil {
				return p, exitf(ExitUsage, "%s: %v", list.flag, strings.TrimPrefix(err.Error(), network.ErrPolicy.Error()+": "))
			}
			*list.rules = append(*list.rules, r)
		}
	}
	if err := p.Validate(); err != nil {
		return p, exitf(ExitUsage, "%s", strings.TrimPrefix(err.Error(), network.ErrPolicy.Error()+": "))
	}
	return p, nil
}

func newRunCmd(g *globals) *cobra.Command {
	f := &runFlags{}
	cmd := &cobra.Command{
		Use:   "run [flags] -- CMD [ARGS...]",
		Short: "Run a command in a fresh sandbox, then destroy it",
		Long: `Run a command in a fresh sandbox on the process wall and destroy the sandbox
when it ends. cage exits with the command's exit code (128+N when a signal
killed it, 124 when the timeout expired, 127 when the command does not exist).
stdin, stdout and stderr are the caller's; when stdin is a terminal the
command gets a PTY.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return exitf(ExitUsage, "no command given (usage: cage run [flags] -- CMD [ARGS...])")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCommand(cmd.Context(), g, f, args, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	cmd.Flags().SetInterspersed(false)
	fl := cmd.Flags()
	fl.StringVar(&f.wall, "wall", "process", "isolation: process (namespaces), runc, gvisor (own kernel in user space), microvm (own kernel in a QEMU VM; template base unless --template)")
	fl.StringVar(&f.template, "template", "", "template the sandbox's root is made from (default host; base on the microvm wall)")
	fl.StringVar(&f.memory, "memory", units.FormatSize(sandbox.DefaultMemory), "memory limit, swap included (e.g. 256M, 1G)")
	fl.Float64Var(&f.cpus, "cpus", sandbox.DefaultCPUs, "CPU limit in cores")
	fl.Int64Var(&f.pids, "pids", sandbox.DefaultPids, "limit on processes and threads")
	fl.StringVar(&f.disk, "disk", units.FormatSize(sandbox.DefaultDisk), "size of the writable storage: /tmp, /var/tmp, /home (RAM-backed)")
	fl.StringVar(&f.shm, "shm", "", "size of /dev/shm (default: the smaller of 64M and a quarter of --memory)")
	fl.StringVar(&f.timeout, "timeout", "10m", "wall-clock limit for the whole sandbox (0: none)")
	fl.StringArrayVarP(&f.env, "env", "e", nil, "environment variable K=V (repeatable)")
	fl.StringVarP(&f.workdir, "workdir", "w", "", "working directory inside the sandbox (default: the user's home)")
	fl.StringVarP(&f.user, "user", "u", "user", "user to run as inside the sandbox (user or root)")
	fl.StringArrayVar(&f.copyIn, "copy-in", nil, "copy a host directory in before running: HOSTDIR:SANDBOXDIR (repeatable)")
	fl.StringVar(&f.maxOutput, "max-output", "", "stop forwarding output after this many bytes (default 64M)")
	fl.StringVar(&f.pty, "tty", "auto", "run in a PTY: auto (when stdin is a terminal), always, never")
	f.net.add(fl)
	return cmd
}

// parsed is a run's validated request.
type parsed struct {
	opts    sandbox.Options
	timeout time.Duration
	env     map[string]string
	copyIn  [][2]string
	maxOut  uint64
}

func (f *runFlags) parse() (*parsed, error) {
	p := &parsed{env: map[string]string{}}
	var err error
	o := &p.opts
	o.Wall, o.Template, o.CPUs, o.Pids = f.wall, f.template, f.cpus, f.pids
	if o.Memory, err = units.ParseSize(f.memory); err != nil {
		return nil, exitf(ExitUsage, "--memory: %v", err)
	}
	if o.Disk, err = units.ParseSize(f.disk); err != nil {
		return nil, exitf(ExitUsage, "--disk: %v", err)
	}
	if f.shm != "" {
		if o.Shm, err = units.ParseSize(f.shm); err != nil {
			return nil, exitf(ExitUsage, "--shm: %v", err)
		}
	}
	if f.maxOutput != "" {
		n, err := units.ParseSize(f.maxOutput)
		if err != nil || n == 0 {
			return nil, exitf(ExitUsage, "--max-output: must be a size above 0")
		}
		p.maxOut = uint64(n)
	}
	if p.timeout, err = units.ParseDuration(f.timeout); err != nil {
		return nil, exitf(ExitUsage, "--timeout: %v", err)
	}
	for _, kv := range f.env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, exitf(ExitUsage, "--env %q: want K=V", kv)
		}
		p.env[k] = v
	}
	for _, c := range f.copyIn {
		host, dst, ok := strings.Cut(c, ":")
		if !ok || host == "" || !strings.HasPrefix(dst, "/") {
			return nil, exitf(ExitUsage, "--copy-in %q: want HOSTDIR:/ABSOLUTE/SANDBOX/DIR", c)
		}
		if fi, err := os.Stat(host); err != nil || !fi.IsDir() {
			return nil, exitf(ExitUsage, "--copy-in: %s is not a directory on this host", host)
		}
		p.copyIn = append(p.copyIn, [2]string{host, dst})
	}
	if f.pty != "auto" && f.pty != "always" && f.pty != "never" {
		return nil, exitf(ExitUsage, "--tty %q: want auto, always or never", f.pty)
	}
	if o.Net, err = f.net.policy(); err != nil {
		return nil, err
	}
	o.Env = p.env
	o.DieWithCaller = true
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return p, nil
}

func runCommand(ctx context.Context, g *globals, f *runFlags, args []string, stdout, stderr io.Writer) error {
	p, err := f.parse()
	if err != nil {
		return err
	}
	trace.Mark("cage main")
	usePTY := f.pty == "always" || (f.pty == "auto" && term.IsTerminal(int(os.Stdin.Fd())))
	oneShot := !usePTY && len(p.copyIn) == 0
	if !oneShot {
		go agent.WarmProtocol() // while the sandbox is made
	}
	host, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return err
	}
	if host.NetConfig.Upstreams, err = network.ParseUpstreams(strings.Split(os.Getenv("CAGE_DNS"), ",")); err != nil {
		return exitf(ExitUsage, "CAGE_DNS: %v", err)
	}
	if t := p.opts.Template; t != "host" && (t != "" || host.DefaultTemplate(p.opts.Wall) != "host") {
		if host.Templates, err = openTemplates(""); err != nil {
			return err
		}
	}
	if ctx == nil {
		ctx = context.Background()
	}
	if oneShot {
		err := runOnce(ctx, host, p, f, args, stdout, stderr)
		if !errors.Is(err, sandbox.ErrNoOneShot) {
			return err
		}
		// Its wall, or its template's start command, needs the agent's
		// server: the usual way.
		go agent.WarmProtocol()
	}
	sb, err := host.Create(ctx, p.opts)
	if err != nil {
		return err
	}
	timedOut, done := aroundRun(ctx, host, sb, p.timeout, stderr)
	defer done()
	client := agentclient.New(sb.Dial, sb.Token())
	defer client.Close()

	for _, c := range p.copyIn {
		if err := copyIn(ctx, client, f.user, c[0], c[1]); err != nil {
			return sandboxFailure(sb, timedOut, p.timeout, fmt.Errorf("--copy-in %s: %w", c[0], err))
		}
	}
	maxOut := p.maxOut // enforced here too: the agent is inside the wall
	if maxOut == 0 {
		maxOut = agent.DefaultMaxOutput
	}
	opts := agentclient.RunOptions{
		Cmd: args[0], Args: args[1:], Cwd: f.workdir, User: f.user, Env: p.env,
		Stdout: stdout, Stderr: stderr, MaxOutput: maxOut,
	}
	var restore func()
	var interrupted atomic.Bool
	gaveUp := make(chan struct{}) // closed at the second signal
	var giveUp sync.Once
	if usePTY {
		// Undone on every way out (a timeout, a second signal): a
		// terminal left raw echoes nothing and ignores Ctrl-C.
		restore = sync.OnceFunc(setupPTY(ctx, client, &opts))
		defer restore()
	} else {
		opts.Stdin = os.Stdin
	}
	// With a terminal too: raw, it sends no SIGINT of its own, but a
	// SIGTERM or SIGHUP from outside (a closed terminal) ended cage at
	// once, its terminal left raw.
	stop := forwardSignals(ctx, client, &opts, func() {
		interrupted.Store(true)
		_ = sb.Destroy()
		giveUp.Do(func() { close(gaveUp) })
	})
	defer stop()
	trace.Mark("run")
	// Run returns once the output is written out, however slowly it is
	// read, unless a second signal says to stop: a consumer of stdout
	// that never reads must not keep cage from ending.
	type ran struct {
		end *pb.ProcessEvent_EndEvent
		err error
	}
	result := make(chan ran, 1)
	go func() {
		end, err := client.Run(ctx, opts)
		result <- ran{end, err}
	}()
	var end *pb.ProcessEvent_EndEvent
	select {
	case r := <-result:
		end, err = r.end, r.err
	case <-gaveUp:
		return exitf(130, "interrupted; the sandbox was destroyed")
	case <-timedOut.expired:
		// The sandbox is gone; what it wrote is still being written
		// out, for a second more at most: the timeout bounds the run.
		select {
		case r := <-result:
			end, err = r.end, r.err
		case <-gaveUp:
			return exitf(130, "interrupted; the sandbox was destroyed")
		case <-time.After(time.Second):
			return sandboxFailure(sb, timedOut, p.timeout, errors.New("timed out"))
		}
	}
	trace.Mark("ended")
	if restore != nil {
		restore()
	}
	if errors.Is(err, syscall.EPIPE) {
		return &exitError{code: 128 + int(syscall.SIGPIPE)}
	}
	if interrupted.Load() {
		return exitf(130, "interrupted; the sandbox was destroyed")
	}
	if err != nil {
		return sandboxFailure(sb, timedOut, p.timeout, err)
	}
	return exitFromEnd(end, args[0], p.opts.Memory, p.opts.Pids, stderr)
}

// runTimeout is a run's --timeout: whether it fired, and a channel
// closed when it did (nil without a timeout: never).
type runTimeout struct {
	fired   atomic.Bool
	expired chan struct{}
}

func (t *runTimeout) Load() bool { return t.fired.Load() }

// aroundRun is what a run does around its command, either way: the
// wall's warning, the GC of killed runs' leftovers, SIGPIPE, the timeout.
// done destroys the sandbox and waits for the GC.
func aroundRun(ctx context.Context, host *sandbox.Host, sb wall.Sandbox, timeout time.Duration, stderr io.Writer) (timedOut *runTimeout, done func()) {
	if w := host.Warning(ctx, sb.Wall()); w != "" {
		fmt.Fprintf(stderr, "cage: warning: %s\n", w)
	}
	// The leftovers of runs that were killed are collected while the command
	// runs: GC leaves alone a state directory younger than its grace period
	// or whose owner lock is held, so this sandbox is not touched. The caches
	// GC prunes only when no sandbox is left are pruned after this one's
	// destruction, before cage exits.
	gcDone := make(chan struct{})
	go func() { defer close(gcDone); trace.Mark("gc"); host.GCBesideRun(); trace.Mark("gc done") }()

	// A closed stdout must not kill cage before it has destroyed the sandbox:
	// writes then fail with EPIPE instead, and cage exits 141 as a shell would.
	signal.Ignore(syscall.SIGPIPE)
	timedOut = &runTimeout{}
	var t *time.Timer
	if timeout > 0 {
		timedOut.expired = make(chan struct{})
		t = time.AfterFunc(timeout, func() {
			timedOut.fired.Store(true)
			_ = sb.Destroy()
			close(timedOut.expired)
		})
	}
	return timedOut, func() {
		if t != nil {
			t.Stop()
		}
		signal.Reset(syscall.SIGPIPE)
		_ = sb.Destroy()
		<-gcDone
		sandbox.PruneIfIdle(host.RunDir)
	}
}

// sandboxFailure explains a failed run: the timeout, a sandbox that died, or
// the command that could not start.
func sandboxFailure(sb wall.Sandbox, timedOut *runTimeout, timeout time.Duration, err error) error {
	if timedOut.Load() {
		return exitf(ExitTimeout, "timed out after %v; the sandbox was destroyed", timeout)
	}
	select {
	case <-sb.Exited():
		return exitf(ExitInternal, "%v", sb.Err())
	default:
	}
	if streamBroke(err) {
		// The stream broke: most likely the sandbox died meanwhile.
		select {
		case <-sb.Exited():
			return exitf(ExitInternal, "%v", sb.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
	if e := commandRefused(err); e != nil {
		return e
	}
	return exitf(ExitInternal, "%v", err)
}

// streamBroke says whether err is the agent's stream breaking off (a
// connection reset, a message cut short: the agent died) rather than an
// answer of the agent's.
func streamBroke(err error) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return true
	}
	switch ce.Code() {
	case connect.CodeUnavailable, connect.CodeUnknown:
		return true
	case connect.CodeInvalidArgument:
		// Connect's client says so of a message cut short.
		return strings.HasPrefix(ce.Message(), "protocol error")
	}
	return false
}

// commandRefused maps the agent's refusal of a command (no such program, not
// executable, bad request, out of a resource) to cage's exit code and the
// agent's message; nil for any other error.
func commandRefused(err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeNotFound:
		return exitf(ExitNotFound, "%s", connectMessage(err))
	case connect.CodePermissionDenied:
		return exitf(ExitNotExec, "%s", connectMessage(err))
	case connect.CodeInvalidArgument:
		return exitf(ExitUsage, "%s", connectMessage(err))
	case connect.CodeResourceExhausted:
		return exitf(ExitInternal, "%s", connectMessage(err))
	}
	return nil
}

func connectMessage(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// exitFromEnd turns how the command ended into cage's exit code.
func exitFromEnd(end *pb.ProcessEvent_EndEvent, cmd string, memory, pids int64, stderr io.Writer) error {
	if end.GetTruncated() {
		fmt.Fprintf(stderr, "cage: output truncated: the command wrote more than the output limit\n")
	}
	code := int(end.GetExitCode())
	if !end.GetExited() {
		code = 128 + signalNumber(end.GetStatus())
	}
	switch end.GetReason() {
	case "oom":
		return exitf(code, "%s was killed: out of memory (limit %s)", cmd, units.FormatSize(memory))
	case "timeout":
		return exitf(ExitTimeout, "%s timed out", cmd)
	case "pids_limit":
		return exitf(code, "%s failed: the process limit (%d) was reached", cmd, pids)
	}
	if code == 0 {
		return nil
	}
	return &exitError{code: code}
}

// signalNumber reads "signal: killed" back into 9.
func signalNumber(status string) int {
	name := strings.TrimPrefix(status, "signal: ")
	for i := 1; i < 65; i++ {
		if syscall.Signal(i).String() == name {
			return i
		}
	}
	return int(syscall.SIGKILL)
}

// forwardSignals passes the first SIGINT/SIGTERM/SIGHUP to the command as
// SIGTERM; a second one (or one before the command started) calls second.
func forwardSignals(ctx context.Context, c *agentclient.Client, opts *agentclient.RunOptions, second func()) func() {
	var pid atomic.Uint32
	prev := opts.OnStart // setupPTY's, for resizes
	opts.OnStart = func(p uint32) {
		pid.Store(p)
		if prev != nil {
			prev(p)
		}
	}
	return onInterrupts(func() bool {
		if pid.Load() == 0 {
			return false
		}
		sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: pid.Load()}}
		// Bounded: an agent that never answers held the signal loop
		// here, and no later signal was seen.
		sctx, cancel := context.WithTimeout(ctx, signalWait)
		defer cancel()
		_, _ = c.Process.SendSignal(sctx, connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGTERM}))
		return true
	}, second)
}

// signalWait bounds how long a signal's RPC waits for the agent's answer.
const signalWait = 2 * time.Second

// onInterrupts calls first at the first SIGINT/SIGTERM/SIGHUP, and second
// at each later one, or at the first when first could not pass it on
// (returned false). The returned func stops listening.
func onInterrupts(first func() bool, second func()) func() {
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		n := 0
		for {
			select {
			case <-ch:
				n++
				if n > 1 || !first() {
					second()
				}
			case <-done:
				return
			}
		}
	}()
	return func() { signal.Stop(ch); close(done) }
}
