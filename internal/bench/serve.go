package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/cgroups"
	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/freeport"
)

// Daemon is a `cage serve` started for a benchmark, with its own state.
type Daemon struct {
	API, Proxy, Key string
	cmd             *exec.Cmd
	data, run       string
	log             *os.File // its standard error
}

func freeAddr() (string, error) { return freeport.Addr("127.0.0.1") }

// StartDaemon runs exe serve with fresh state and an API key; extra are
// more flags of serve.
func StartDaemon(exe string, pool int, extra ...string) (*Daemon, error) {
	d := &Daemon{}
	var err error
	if d.data, err = os.MkdirTemp("", "cage-bench-data-"); err != nil {
		return nil, err
	}
	if d.run, err = os.MkdirTemp("/run", "cage-bench-"); err != nil {
		return nil, err
	}
	_ = os.Chmod(d.run, 0o711)
	out, err := exec.Command(exe, "keys", "create", "--data", d.data).Output()
	if err != nil {
		return nil, fmt.Errorf("keys create: %v", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	d.Key = lines[len(lines)-1]
	api, err := freeAddr()
	if err != nil {
		return nil, err
	}
	px, err := freeAddr()
	if err != nil {
		return nil, err
	}
	d.API, d.Proxy = "http://"+api, "http://"+px
	d.cmd = exec.Command(exe, append([]string{"--run-dir", d.run, "serve", "--data", d.data, "--api", api, "--proxy", px,
		"--pool", strconv.Itoa(pool)}, extra...)...)
	// Its log is kept where a failed request's detail can be read: the
	// file stays after Stop when the daemon logged an error.
	if d.log, err = os.CreateTemp("", "cage-bench-daemon-*.log"); err != nil {
		return nil, err
	}
	d.cmd.Stderr = d.log
	if err := d.cmd.Start(); err != nil {
		return nil, err
	}
	for i := 0; i < 300; i++ {
		resp, err := http.Get(d.API + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return d, nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	d.Stop()
	return nil, fmt.Errorf("cage serve did not become ready")
}

// Pid is the daemon's process id.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// Stop ends the daemon and removes its sandboxes and state.
func (d *Daemon) Stop() {
	c := d.Client()
	if list, err := c.List(context.Background(), nil); err == nil {
		// A thousand left alive by a rate measurement: 8 kills at a time.
		ids := make(chan string)
		var wg sync.WaitGroup
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for id := range ids {
					_ = c.Kill(context.Background(), id)
				}
			}()
		}
		for _, s := range list {
			ids <- s.SandboxID
		}
		close(ids)
		wg.Wait()
	}
	if d.cmd != nil && d.cmd.Process != nil {
		_ = d.cmd.Process.Signal(os.Interrupt)
		_ = d.cmd.Wait()
	}
	os.RemoveAll(d.data)
	unmountUnder(d.run)
	os.RemoveAll(d.run)
	if d.log != nil {
		d.log.Close()
		if b, err := os.ReadFile(d.log.Name()); err == nil && bytes.Contains(b, []byte("level=ERROR")) {
			fmt.Fprintf(os.Stderr, "cage bench: the daemon logged errors; its log is kept in %s\n", d.log.Name())
		} else {
			os.Remove(d.log.Name())
		}
	}
}

func unmountUnder(dir string) {
	data, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			_ = exec.Command("umount", "-l", f[4]).Run()
		}
	}
}

// Client is a client of the daemon.
func (d *Daemon) Client() *client.Client { return client.New(d.API, d.Proxy, d.Key) }

// TimeToInteractive is the public ComputeSDK benchmark's measure: create a
// sandbox through the API, run a command through the proxy, time to its
// first output byte. concurrency > 1 runs that many at once (a burst).
func TimeToInteractive(ctx context.Context, c *client.Client, runs, concurrency int) (stats.Stats, error) {
	return TimeToInteractiveBursts(ctx, c, runs, concurrency, nil)
}

// TimeToInteractiveBursts is TimeToInteractive with before run ahead of
// each burst (nil: none), outside the samples.
func TimeToInteractiveBursts(ctx context.Context, c *client.Client, runs, concurrency int, before func() error) (stats.Stats, error) {
	var mu sync.Mutex
	var samples []time.Duration
	var firstErr error
	one := func(record bool) {
		start := time.Now()
		sb, err := c.Create(ctx, hostSandbox(120))
		if err == nil {
			var ac *agentclient.Client
			if ac, err = c.Agent(sb.SandboxID, sb.EnvdAccessToken); err == nil {
				fw := &firstWrite{start: start}
				end, runErr := ac.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"ready"}, Stdout: fw, Stderr: io.Discard})
				ac.Close()
				if err = runErr; err == nil {
					err = fw.check(end.GetExitCode())
				}
				if err == nil && record {
					mu.Lock()
					samples = append(samples, fw.at)
					mu.Unlock()
				}
			}
			_ = c.Kill(ctx, sb.SandboxID)
		}
		if err != nil {
			mu.Lock()
			if firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		}
	}
	for i := 0; i < 3; i++ {
		one(false)
	}
	for done := 0; done < runs; done += concurrency {
		if before != nil {
			if err := before(); err != nil {
				return stats.Summarize(samples), err
			}
		}
		var wg sync.WaitGroup
		for k := 0; k < concurrency && done+k < runs; k++ {
			wg.Add(1)
			go func() { defer wg.Done(); one(true) }()
		}
		wg.Wait()
	}
	return stats.Summarize(samples), firstErr
}

// hostSandbox is a create request for a sandbox of the host template that
// lives timeout seconds.
func hostSandbox(timeout int64) types.NewSandboxV2 {
	return types.NewSandboxV2{TemplateID: "host", Timeout: &timeout}
}

// ProxyRoundTrip times Start -> end of `true` in one sandbox through the
// daemon's proxy, as an SDK's commands.run does.
func ProxyRoundTrip(ctx context.Context, c *client.Client, runs int) (stats.Stats, error) {
	sb, err := c.Create(ctx, hostSandbox(600))
	if err != nil {
		return stats.Stats{}, err
	}
	defer c.Kill(ctx, sb.SandboxID)
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		return stats.Stats{}, err
	}
	defer ac.Close()
	var samples []time.Duration
	for i := -5; i < runs; i++ {
		start := time.Now()
		if _, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard}); err != nil {
			return stats.Stats{}, err
		}
		if i >= 0 {
			samples = append(samples, time.Since(start))
		}
	}
	return stats.Summarize(samples), nil
}

// DaemonLoad creates n sandboxes through the API and reports the creation
// rate and the daemon's resident memory with all of them alive.
func DaemonLoad(ctx context.Context, d *Daemon, n, concurrency int) (rate float64, rssBefore, rssAfter int64, err error) {
	rssBefore = rss(d.Pid())
	rate, err = CreateMany(ctx, d.Client(), n, concurrency)
	time.Sleep(time.Second)
	return rate, rssBefore, rss(d.Pid()), err
}

// CreateMany creates n sandboxes through the API, concurrency at a time,
// and leaves them alive; it returns the rate of creates a second. A
// create that fails ends it with that error.
func CreateMany(ctx context.Context, c *client.Client, n, concurrency int) (rate float64, err error) {
	rate, _, err = createMany(ctx, c, n, concurrency)
	return rate, err
}

// createMany is CreateMany that also returns the sandboxes' ids.
func createMany(ctx context.Context, c *client.Client, n, concurrency int) (rate float64, ids []string, err error) {
	start := time.Now()
	var mu sync.Mutex
	err = inTurn(n, concurrency, func(i int) error {
		sb, err := c.Create(ctx, hostSandbox(600))
		if err != nil {
			return fmt.Errorf("create %d of %d: %w", i, n, err)
		}
		mu.Lock()
		ids = append(ids, sb.SandboxID)
		mu.Unlock()
		return nil
	})
	return float64(n) / time.Since(start).Seconds(), ids, err
}

// Rates is the API's create rate with few sandboxes alive and with many.
type Rates struct {
	Empty, Full       float64  // creates a second: the first window, the last
	EmptyCPU, FullCPU CPUSplit // the CPU each of their creates took
	Alive             int      // sandboxes alive at the end
	RSSBefore         int64    // the daemon's resident memory before
	RSSFull           int64    // ... with Alive sandboxes alive
	Window, Conns     int
}

// CreateRates creates alive sandboxes through the API, concurrency at a
// time: the rate of the first window creates (next to none alive) and of
// the last window (next to alive), so that a rate that falls as sandboxes
// pile up shows, and what each create of those windows cost in CPU, and
// where. They stay alive (Daemon.Stop removes them).
func CreateRates(ctx context.Context, d *Daemon, alive, window, concurrency int) (Rates, error) {
	window = max(1, min(window, alive/2))
	r := Rates{Alive: alive, Window: window, Conns: concurrency, RSSBefore: rss(d.Pid())}
	c := d.Client()
	var err error
	if r.Empty, r.EmptyCPU, err = cpuWindow(ctx, d, c, window, concurrency); err != nil {
		return r, err
	}
	if _, err = CreateMany(ctx, c, alive-2*window, concurrency); err != nil {
		return r, err
	}
	if r.Full, r.FullCPU, err = cpuWindow(ctx, d, c, window, concurrency); err != nil {
		return r, err
	}
	time.Sleep(time.Second)
	r.RSSFull = rss(d.Pid())
	return r, nil
}

// CPUSplit is the CPU time of one create through the API, and where it
// went: the whole host's busy time while the window's creates ran, the
// sandboxes' own cgroups (each read once its create has answered: its
// agent's start, root and seal, and its fork, which the spawner makes
// from a thread in the group; for a pooled one, its preparing too), the
// daemon's process and its spawner's. The parts overlap (the spawner's
// forks) and do not add up to the host's: the rest is the kernel's own
// threads, the client, and anything else running on the host.
type CPUSplit struct {
	Host, Sandboxes, Daemon, Spawner time.Duration
}

// cpuWindow runs createMany and splits its CPU per create (see CPUSplit).
func cpuWindow(ctx context.Context, d *Daemon, c *client.Client, n, concurrency int) (float64, CPUSplit, error) {
	cg, err := cgroups.Detect("cage")
	if err != nil {
		return 0, CPUSplit{}, err
	}
	hostBefore, daemonBefore, spawnerBefore := hostBusy(), procCPU(d.Pid()), procCPU(spawnerOf(d.Pid()))
	rate, ids, err := createMany(ctx, c, n, concurrency)
	if err != nil {
		return rate, CPUSplit{}, err
	}
	var s CPUSplit
	s.Host = (hostBusy() - hostBefore) / time.Duration(n)
	s.Daemon = (procCPU(d.Pid()) - daemonBefore) / time.Duration(n)
	s.Spawner = (procCPU(spawnerOf(d.Pid())) - spawnerBefore) / time.Duration(n)
	for _, id := range ids {
		u, err := cg.Open(id).Usage()
		if err != nil {
			return rate, s, fmt.Errorf("sandbox %s's cgroup: %w", id, err)
		}
		s.Sandboxes += time.Duration(u.CPUNanos)
	}
	s.Sandboxes /= time.Duration(n)
	return rate, s, nil
}

// userHZ is the unit of /proc's CPU times (USER_HZ, 100 on every Linux
// architecture cage runs on).
const userHZ = 100

// hostBusy is the CPU time every CPU of the host has been busy (not idle,
// not waiting for I/O) since boot.
func hostBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	var ticks int64
	for i, f := range fields[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, _ := strconv.ParseInt(f, 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * time.Second / userHZ
}

// procCPU is CPUTime, 0 for no process (pid 0, or one gone).
func procCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	d, _ := CPUTime(pid)
	return d
}

// procStat is /proc/PID/stat's fields, the command name (which may hold
// spaces) as one.
func procStat(pid int) []string {
	if pid <= 0 {
		return nil
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return nil
	}
	s := string(b)
	i, j := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if i < 0 || j < i || j+2 > len(s) {
		return nil
	}
	return append([]string{s[:i-1], s[i+1 : j]}, strings.Fields(s[j+2:])...)
}

// spawnerOf is the pid of the daemon's spawner (its child cage-agent), 0
// when it has none. A child is listed under the thread that forked it.
func spawnerOf(daemon int) int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", daemon))
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			pid, _ := strconv.Atoi(f)
			if st := procStat(pid); len(st) > 1 && st[1] == "cage-agent" {
				return pid
			}
		}
	}
	return 0
}

func rss(pid int) int64 {
	f, err := os.Open(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// FreeAddr is a loopback address no one listens on now.
func FreeAddr() (string, error) { return freeAddr() }

// WaitPoolsFull waits until every pool the daemon's /metrics (at
// metricsAddr) shows holds as many sandboxes as it keeps now.
func WaitPoolsFull(ctx context.Context, metricsAddr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		ready, size, err := poolGauges(ctx, "http://"+metricsAddr+"/metrics")
		if err == nil && size > 0 && ready == size {
			return nil
		}
		last = fmt.Sprintf("%d of %d ready (%v)", ready, size, err)
		if time.Now().After(deadline) {
			return fmt.Errorf("the pools hold %s after %v", last, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// poolGauges sums cage_pool_ready and cage_pool_size over every pool.
func poolGauges(ctx context.Context, url string) (ready, size int, err error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		name, rest, _ := strings.Cut(line, "{")
		f := strings.Fields(rest)
		if len(f) == 0 || (name != "cage_pool_ready" && name != "cage_pool_size") {
			continue
		}
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %q", url, line)
		}
		if name == "cage_pool_ready" {
			ready += int(v)
		} else {
			size += int(v)
		}
	}
	return ready, size, sc.Err()
}
