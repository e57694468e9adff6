// Package cageserve runs `cage serve` for tests that meet the daemon as its
// users and its attackers do: a process of its own with its own data and
// run directories, a first API key, and two loopback listeners. It also
// reads what the host says of the daemon and of a sandbox's agent (memory,
// pids), so that a test can bound what an attack costs them.
package cageserve

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil"
)

// EnvdPort is the port E2B's SDKs address the agent on.
const EnvdPort = "49983"

// Daemon is one `cage serve`.
type Daemon struct {
	t      testing.TB
	bin    string
	Data   string
	RunDir string
	API    string // host:port of the control API
	Proxy  string // host:port of the sandbox proxy
	Key    string // the first API key
	HTTP   *http.Client

	log     *testutil.SyncBuffer
	args    []string
	cmd     *exec.Cmd
	done    chan struct{}
	mu      sync.Mutex
	created map[string]string // sandbox id -> key
}

// Start makes the directories and a key, starts `cage serve --pool 0
// FLAGS...` and waits for /health. The test's cleanup kills the sandboxes it
// made, stops the daemon, removes what is left and, on failure, prints the
// daemon's output.
func Start(t testing.TB, flags ...string) *Daemon {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	bin := filepath.Join(testutil.Binaries(t), "cage")
	runDir, err := os.MkdirTemp("/run", "cage-abuse-test-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(runDir, 0o711); err != nil { // sandbox roots traverse it
		t.Fatal(err)
	}
	d := &Daemon{t: t, bin: bin, Data: t.TempDir(), RunDir: runDir, API: freePort(t), Proxy: freePort(t),
		HTTP: &http.Client{Timeout: 2 * time.Minute}, log: &testutil.SyncBuffer{}, created: map[string]string{}}
	t.Cleanup(func() { testutil.RemoveRunDir(runDir) })
	d.Key = d.NewKey(t, "first")
	t.Cleanup(d.cleanup)
	d.args = append([]string{"--debug", "--run-dir", runDir, "serve", "--data", d.Data, "--api", d.API,
		"--proxy", d.Proxy, "--pool", "0"}, flags...)
	d.run(t)
	return d
}

// Stop ends the daemon with sig (SIGTERM; SIGKILL as a crash) and waits
// for it; its sandboxes keep running, for Restart to adopt.
func (d *Daemon) Stop(sig syscall.Signal) {
	_ = d.cmd.Process.Signal(sig)
	<-d.done
}

// Restart starts the daemon again, stopped by Stop, on the same
// directories, ports and flags, and waits for /health.
func (d *Daemon) Restart(t testing.TB) {
	t.Helper()
	d.run(t)
}

func (d *Daemon) run(t testing.TB) {
	t.Helper()
	d.cmd = d.cage(d.args...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd, done := d.cmd, make(chan struct{})
	d.done = done
	go func() { _ = cmd.Wait(); close(done) }()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get("http://" + d.API + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-d.done:
			t.Fatalf("cage serve exited before answering /health:\n%s", d.log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("cage serve did not answer /health within 30 s:\n%s", d.log.String())
		}
	}
}

func (d *Daemon) cage(args ...string) *exec.Cmd {
	cmd := exec.Command(d.bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAGE_") || strings.HasPrefix(kv, "CAGE_RUNSC=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

var keyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// NewKey creates another API key (another tenant).
func (d *Daemon) NewKey(t testing.TB, name string) string {
	t.Helper()
	out, err := d.cage("keys", "create", "--data", d.Data, "--name", name).Output()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if err != nil || !keyRE.MatchString(lines[len(lines)-1]) {
		t.Fatalf("cage keys create: %v: %s", err, out)
	}
	return lines[len(lines)-1]
}

// NewKeyIn creates an API key in a team (`cage keys create --team`), or an
// admin key when team is "admin".
func (d *Daemon) NewKeyIn(t testing.TB, name, team string) string {
	t.Helper()
	flag := []string{"--team", team}
	if team == "admin" {
		flag = []string{"--admin"}
	}
	out, err := d.cage(append([]string{"keys", "create", "--data", d.Data, "--name", name}, flag...)...).Output()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if err != nil || !keyRE.MatchString(lines[len(lines)-1]) {
		t.Fatalf("cage keys create --team %s: %v: %s", team, err, out)
	}
	return lines[len(lines)-1]
}

// Cage runs the cage CLI on the daemon's host (its data directory is
// --data's, to pass), and returns its standard output and error.
func (d *Daemon) Cage(args ...string) (stdout, stderr []byte, err error) {
	cmd := d.cage(args...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err = cmd.Run()
	return []byte(out.String()), []byte(errb.String()), err
}

// FreePort is a loopback address:port nothing listens on now.
func FreePort(t testing.TB) string { return freePort(t) }

// PID is the daemon's pid.
func (d *Daemon) PID() int { return d.cmd.Process.Pid }

// Do sends an API request with key (none when "") and a JSON body (nil:
// none; []byte: as it is) and returns the status and body.
func (d *Daemon) Do(method, path, key string, body any) (int, []byte, error) {
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, "http://"+d.API+path, rd)
	if err != nil {
		return 0, nil, err
	}
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.HTTP.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// Create creates a sandbox with key (body: the create request; templateID
// defaults to host) and fails the test unless it gets 201.
func (d *Daemon) Create(t testing.TB, key string, body map[string]any) types.Sandbox {
	t.Helper()
	sb, status, msg := d.TryCreate(key, body)
	if status != http.StatusCreated {
		t.Fatalf("create: %d %s", status, msg)
	}
	return sb
}

// TryCreate is Create that returns the status and message instead.
func (d *Daemon) TryCreate(key string, body map[string]any) (types.Sandbox, int, string) {
	b := map[string]any{"templateID": "host"}
	for k, v := range body {
		b[k] = v
	}
	status, out, err := d.Do(http.MethodPost, "/v2/sandboxes", key, b)
	if err != nil {
		return types.Sandbox{}, 0, err.Error()
	}
	var sb types.Sandbox
	if status == http.StatusCreated {
		if err := json.Unmarshal(out, &sb); err != nil {
			return sb, 0, err.Error()
		}
		d.mu.Lock()
		d.created[sb.SandboxID] = key
		d.mu.Unlock()
	}
	return sb, status, string(out)
}

// Kill removes a sandbox through the API.
func (d *Daemon) Kill(key, id string) {
	_, _, _ = d.Do(http.MethodDelete, "/sandboxes/"+id, key, nil)
}

// Agent is a client of a sandbox's agent through the proxy (E2B's headers).
func (d *Daemon) Agent(id, token string) *agentclient.Client {
	h := http.Header{}
	h.Set("E2b-Sandbox-Id", id)
	h.Set("E2b-Sandbox-Port", EnvdPort)
	return agentclient.NewWithHeaders(func(ctx context.Context) (net.Conn, error) {
		var dl net.Dialer
		return dl.DialContext(ctx, "tcp", d.Proxy)
	}, token, h)
}

func (d *Daemon) cleanup() {
	d.mu.Lock()
	for id, key := range d.created {
		d.Kill(key, id)
	}
	d.mu.Unlock()
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
	out := d.log.String()
	if strings.Contains(out, "panic:") || strings.Contains(out, "goroutine ") {
		d.t.Errorf("cage serve printed a Go panic or stack trace")
	}
	if d.t.Failed() {
		if len(out) > 64<<10 {
			out = out[len(out)-64<<10:]
		}
		d.t.Logf("cage serve output:\n%s", out)
	}
}

// AgentPID finds the host pid of a sandbox's agent: PID 1 of its PID
// namespace, in the sandbox's cage cgroup.
func AgentPID(id string) (int, error) {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if !strings.Contains(string(cg), "/cage/"+id) {
			continue
		}
		if f, _ := statusField(pid, "NSpid"); len(f) > 1 && f[len(f)-1] == "1" {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no agent of sandbox %s on this host", id)
}

// Memory reads VmRSS and VmHWM (the peak) of process pid, in bytes.
func Memory(pid int) (rss, peak int64, err error) {
	for _, f := range []struct {
		name string
		dst  *int64
	}{{"VmRSS", &rss}, {"VmHWM", &peak}} {
		v, err := statusField(pid, f.name)
		if err != nil {
			return 0, 0, err
		}
		if len(v) != 2 || v[1] != "kB" {
			return 0, 0, fmt.Errorf("/proc/%d/status %s: %q", pid, f.name, v)
		}
		kb, err := strconv.ParseInt(v[0], 10, 64)
		if err != nil {
			return 0, 0, err
		}
		*f.dst = kb << 10
	}
	return rss, peak, nil
}

func statusField(pid int, name string) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == name {
			return strings.Fields(v), nil
		}
	}
	return nil, fmt.Errorf("/proc/%d/status has no %s", pid, name)
}

func freePort(t testing.TB) string { return testutil.FreeLoopback(t) }
