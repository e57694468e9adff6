// Package bench measures what users feel: how long a sandbox takes to start
// and answer, and what it costs the host. Figures are percentiles from one
// run, next to a peer measured in the same run, because these machines are
// shared and noisy: only ratios from one run compare.
package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"github.com/cagehq/cage/internal/bench/stats"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/wall"
)

// WholeProcess times argv run to completion, runs times, after 3 warm-ups.
func WholeProcess(argv []string, runs int) (stats.Stats, error) {
	var samples []time.Duration
	for i := -3; i < runs; i++ {
		cmd := exec.Command(argv[0], argv[1:]...)
		start := time.Now()
		out, err := cmd.CombinedOutput()
		d := time.Since(start)
		if err != nil {
			return stats.Stats{}, fmt.Errorf("%s: %v: %s", strings.Join(argv, " "), err, bytesLine(out))
		}
		if i >= 0 {
			samples = append(samples, d)
		}
	}
	return stats.Summarize(samples), nil
}

// Interleaved times several commands round-robin, so drift on a shared
// machine hits them alike.
func Interleaved(argvs [][]string, runs int) ([]stats.Stats, error) {
	samples := make([][]time.Duration, len(argvs))
	for i := -3; i < runs; i++ {
		for k, argv := range argvs {
			cmd := exec.Command(argv[0], argv[1:]...)
			start := time.Now()
			out, err := cmd.CombinedOutput()
			d := time.Since(start)
			if err != nil {
				return nil, fmt.Errorf("%s: %v: %s", strings.Join(argv, " "), err, bytesLine(out))
			}
			if i >= 0 {
				samples[k] = append(samples[k], d)
			}
		}
	}
	out := make([]stats.Stats, len(argvs))
	for k := range samples {
		out[k] = stats.Summarize(samples[k])
	}
	return out, nil
}

func bytesLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

// BwrapArgv is the peer for `cage run -- true`: bubblewrap with every
// namespace, the same host directories read-only, fresh /proc, /dev and /tmp.
func BwrapArgv(cmd ...string) ([]string, error) {
	bw, err := exec.LookPath("bwrap")
	if err != nil {
		return nil, errors.New("bwrap is not installed (apt-get install bubblewrap)")
	}
	argv := []string{bw, "--unshare-all", "--die-with-parent"}
	for _, d := range []string{"/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"} {
		if fi, err := os.Lstat(d); err == nil {
			if fi.Mode()&os.ModeSymlink != 0 {
				t, _ := os.Readlink(d)
				argv = append(argv, "--symlink", t, d)
			} else {
				argv = append(argv, "--ro-bind", d, d)
			}
		}
	}
	argv = append(argv, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/home")
	return append(argv, cmd...), nil
}

// CreateToFirstOutput times, in this process, create → the first byte of
// `echo ready` on stdout, then destroys the sandbox (not timed).
func CreateToFirstOutput(ctx context.Context, h *sandbox.Host, runs int) (stats.Stats, error) {
	return WallToFirstOutput(ctx, h, "process", runs, 3)
}

// WallToFirstOutput is CreateToFirstOutput on a given wall, after warm
// unmeasured runs.
func WallToFirstOutput(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int) (stats.Stats, error) {
	s, _, err := WallToFirstOutputBlocks(ctx, h, wallName, runs, warm)
	return s, err
}

// blockCounter is a sandbox whose emulator can say how many blocks of
// guest code it has translated (a microVM's QEMU; 0 under KVM).
type blockCounter interface {
	TranslatedBlocks(ctx context.Context) (int, error)
}

// WallToFirstOutputBlocks is WallToFirstOutput that also returns, for
// each sample, the blocks of guest code the sandbox's emulator translated
// from its start to the end of the first command (none on a wall without
// an emulator, or where one could not be read): under TCG where a
// microVM's time goes, and unlike the time not moved by the host's load.
func WallToFirstOutputBlocks(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int) (stats.Stats, []int, error) {
	var samples []time.Duration
	var blocks []int
	for i := -warm; i < runs; i++ {
		d, n, err := firstOutputSample(ctx, h, wallName, i >= 0)
		if err != nil {
			return stats.Stats{}, nil, err
		}
		if i >= 0 {
			samples = append(samples, d)
			if n > 0 {
				blocks = append(blocks, n)
			}
		}
	}
	return stats.Summarize(samples), blocks, nil
}

// firstOutputSample is one create -> first output of `echo ready` on the
// wall, the sandbox destroyed after (not timed); with count, also the
// blocks its emulator translated (0 where none or not known).
func firstOutputSample(ctx context.Context, h *sandbox.Host, wallName string, count bool) (time.Duration, int, error) {
	start := time.Now()
	sb, err := h.Create(ctx, sandbox.Options{Wall: wallName})
	if err != nil {
		return 0, 0, err
	}
	c := agentclient.New(sb.Dial, sb.Token())
	fw := &firstWrite{start: start}
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"ready"}, Stdout: fw, Stderr: io.Discard})
	c.Close()
	if err == nil {
		err = fw.check(end.GetExitCode())
	}
	n := 0
	if bc, ok := sb.(blockCounter); ok && err == nil && count {
		n, _ = bc.TranslatedBlocks(ctx) // not known: no figure
	}
	if derr := sb.Destroy(); err == nil {
		err = derr
	}
	return fw.at, n, err
}

// CreateToFirstOutputVs is CreateToFirstOutput with its peer, a sample of
// which follows each of cage's (see Alternate).
func CreateToFirstOutputVs(ctx context.Context, h *sandbox.Host, runs int, peer func() (time.Duration, error)) (cage, peers stats.Stats, err error) {
	return Alternate(runs, 3, func() (time.Duration, error) {
		d, _, err := firstOutputSample(ctx, h, "process", false)
		return d, err
	}, peer)
}

// Alternate takes runs samples of cage and of its peer, one of each in
// turn after warm rounds of both, so that drift on a shared machine hits
// them alike; a sample's error ends it.
func Alternate(runs, warm int, cage, peer func() (time.Duration, error)) (stats.Stats, stats.Stats, error) {
	var a, b []time.Duration
	for i := -warm; i < runs; i++ {
		x, err := cage()
		if err != nil {
			return stats.Stats{}, stats.Stats{}, err
		}
		y, err := peer()
		if err != nil {
			return stats.Stats{}, stats.Stats{}, fmt.Errorf("the peer: %w", err)
		}
		if i >= 0 {
			a, b = append(a, x), append(b, y)
		}
	}
	return stats.Summarize(a), stats.Summarize(b), nil
}

// FirstOutput runs argv and times its start to the first byte on its
// stdout; it must then exit 0 (a peer that failed or printed nothing is
// no sample).
func FirstOutput(argv []string) (time.Duration, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	var buf [1]byte
	n, rerr := out.Read(buf[:])
	d := time.Since(start)
	_, _ = io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("%s: %v: %s", argv[0], err, bytesLine([]byte(stderr.String())))
	}
	if n == 0 {
		return 0, fmt.Errorf("%s printed nothing: %v", argv[0], rerr)
	}
	return d, nil
}

// RunRate runs n copies of argv to completion, concurrency at a time, and
// returns how many it finished a second.
func RunRate(argv []string, n, concurrency int) (float64, error) {
	start := time.Now()
	err := inTurn(n, concurrency, func(int) error {
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", argv[0], err, bytesLine(out))
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// inTurn calls f n times (with 1..n), concurrency calls at a time, and
// stops handing out calls at the first error, which it returns.
func inTurn(n, concurrency int, f func(i int) error) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		next int
		ferr error
	)
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				if next >= n || ferr != nil {
					mu.Unlock()
					return
				}
				next++
				i := next
				mu.Unlock()
				if err := f(i); err != nil {
					mu.Lock()
					if ferr == nil {
						ferr = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return ferr
}

type firstWrite struct {
	start time.Time
	at    time.Duration
}

func (f *firstWrite) Write(p []byte) (int, error) {
	if f.at == 0 && len(p) > 0 {
		f.at = time.Since(f.start)
	}
	return len(p), nil
}

// check refuses a run that failed or printed nothing: it has no time to
// first output, and a 0 would pass for the fastest sample.
func (f *firstWrite) check(exit int32) error {
	if exit != 0 {
		return fmt.Errorf("echo exited %d", exit)
	}
	if f.at <= 0 {
		return errors.New("echo printed nothing")
	}
	return nil
}

// BareToFirstOutput times the peer of an OCI wall: the runtime running
// `echo ready` as the container process of an equivalent bundle, to the
// first byte of its output (cleaning up is not timed).
func BareToFirstOutput(ctx context.Context, h *sandbox.Host, wallName string, runs, warm int) (stats.Stats, error) {
	var samples []time.Duration
	for i := -warm; i < runs; i++ {
		fw := &firstWrite{start: time.Now()}
		if err := h.RunBare(ctx, wallName, []string{"/bin/echo", "ready"}, fw); err != nil {
			return stats.Stats{}, err
		}
		if err := fw.check(0); err != nil {
			return stats.Stats{}, fmt.Errorf("bare %s: %w", wallName, err)
		}
		if i >= 0 {
			samples = append(samples, fw.at)
		}
	}
	return stats.Summarize(samples), nil
}

// RoundTrip times Start → end of `true` in one live sandbox, and its peer
// sample by sample: the same `true` forked, run and waited for by this
// process, its output read through pipes as the agent reads it (the floor
// the machine sets under any round trip: a fork, an exec of a dynamic
// binary and an exit, whose page faults cost what the hypervisor says).
func RoundTrip(ctx context.Context, h *sandbox.Host, runs int) (cage, peer stats.Stats, err error) {
	trueBin, err := exec.LookPath("true")
	if err != nil {
		return cage, peer, fmt.Errorf("the peer's true: %w", err)
	}
	sb, err := h.Create(ctx, sandbox.Options{})
	if err != nil {
		return cage, peer, err
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	var samples, bare []time.Duration
	for i := -5; i < runs; i++ {
		start := time.Now()
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
		d := time.Since(start)
		if err != nil {
			return cage, peer, err
		}
		if end.GetExitCode() != 0 {
			return cage, peer, fmt.Errorf("true exited %d", end.GetExitCode())
		}
		b, err := bareTrue(trueBin)
		if err != nil {
			return cage, peer, err
		}
		if i >= 0 {
			samples = append(samples, d)
			bare = append(bare, b)
		}
	}
	return stats.Summarize(samples), stats.Summarize(bare), nil
}

// bareTrue forks and execs path with its stdout and stderr on pipes, reads
// both to their end and waits for it: the least a round trip can be.
func bareTrue(path string) (time.Duration, error) {
	var p [2][2]int
	for i := range p {
		if err := syscall.Pipe2(p[i][:], syscall.O_CLOEXEC); err != nil {
			return 0, err
		}
	}
	defer func() {
		for _, fds := range p {
			syscall.Close(fds[0])
		}
	}()
	start := time.Now()
	pid, err := syscall.ForkExec(path, []string{"true"}, &syscall.ProcAttr{Files: []uintptr{^uintptr(0), uintptr(p[0][1]), uintptr(p[1][1])}})
	syscall.Close(p[0][1])
	syscall.Close(p[1][1])
	if err != nil {
		return 0, fmt.Errorf("the peer's true: %w", err)
	}
	var buf [512]byte
	for _, fds := range p {
		for {
			n, err := syscall.Read(fds[0], buf[:])
			if err == syscall.EINTR {
				continue
			}
			if n <= 0 {
				break
			}
		}
	}
	var ws syscall.WaitStatus
	for {
		_, err = syscall.Wait4(pid, &ws, 0, nil)
		if err != syscall.EINTR {
			break
		}
	}
	d := time.Since(start)
	if err != nil {
		return 0, err
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
		return 0, fmt.Errorf("the peer's true ended: %v", ws)
	}
	return d, nil
}

// Memory is the host memory that n idle sandboxes cost.
type Memory struct {
	N               int
	PerSandboxBytes int64 // drop of MemAvailable, divided by N
	AgentPSSBytes   int64 // mean proportional set size of an idle agent
	CgroupBytes     int64 // mean memory charged to a sandbox's cgroup
	CreateRate      float64
}

// IdleMemory creates n sandboxes, lets them idle, and measures.
func IdleMemory(ctx context.Context, h *sandbox.Host, n int) (Memory, error) {
	return WallIdleMemory(ctx, h, "process", n)
}

// WallIdleMemory is IdleMemory on a given wall.
func WallIdleMemory(ctx context.Context, h *sandbox.Host, wallName string, n int) (Memory, error) {
	before, err := memAvailable()
	if err != nil {
		return Memory{}, err
	}
	var sbs []wall.Sandbox
	defer func() {
		for _, sb := range sbs {
			_ = sb.Destroy()
		}
	}()
	start := time.Now()
	for i := 0; i < n; i++ {
		sb, err := h.Create(ctx, sandbox.Options{Wall: wallName})
		if err != nil {
			return Memory{}, fmt.Errorf("sandbox %d: %w", i, err)
		}
		sbs = append(sbs, sb)
		// Wait until it answers, so it is a fully started, idle sandbox.
		c := agentclient.New(sb.Dial, sb.Token())
		_, err = c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
		c.Close()
		if err != nil {
			return Memory{}, fmt.Errorf("sandbox %d: %w", i, err)
		}
	}
	rate := float64(n) / time.Since(start).Seconds()
	time.Sleep(2 * time.Second) // let the agents settle
	after, err := memAvailable()
	if err != nil {
		return Memory{}, err
	}
	var pss, cg int64
	for _, sb := range sbs {
		p, err := ReadPSS(sb.AgentPID())
		if err != nil {
			return Memory{}, err
		}
		c, err := readCgroupMemory(sb)
		if err != nil {
			return Memory{}, err
		}
		pss, cg = pss+p, cg+c
	}
	return Memory{N: n, PerSandboxBytes: (before - after) / int64(n), AgentPSSBytes: pss / int64(n),
		CgroupBytes: cg / int64(n), CreateRate: rate}, nil
}

func memAvailable() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			return parseKB(v)
		}
	}
	return 0, errors.New("no MemAvailable in /proc/meminfo")
}

// ReadPSS is the proportional set size of process pid.
func ReadPSS(pid int) (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "Pss:"); ok {
			return parseKB(v)
		}
	}
	return 0, fmt.Errorf("no Pss in /proc/%d/smaps_rollup", pid)
}

// parseKB reads "  1234 kB".
func parseKB(v string) (int64, error) {
	kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
	if err != nil || kb < 0 {
		return 0, fmt.Errorf("memory figure %q: not a count of kB", v)
	}
	return kb << 10, nil
}

func readCgroupMemory(sb wall.Sandbox) (int64, error) {
	dir := sb.Cgroup().Dir("memory")
	for _, f := range []string{"memory.usage_in_bytes", "memory.current"} {
		if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
			return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		}
	}
	return 0, fmt.Errorf("no memory usage in %s", dir)
}
