// Package daemontest runs `cage serve` as a user meets it: the real binary
// with its own data and run directories, driven over its control API (every
// request and response checked against api/openapi.yaml), its sandbox proxy
// and the cage CLI, killed with SIGKILL and restarted, and the host checked
// afterwards for anything left behind.
//
// Needs root, user namespaces, the mount API and cgroups; nothing leaves the
// loopback interface.
package daemontest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
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

	"connectrpc.com/connect"

	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
	"github.com/cagehq/cage/api/gen/process/processconnect"
	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/apispec"
	"github.com/cagehq/cage/internal/testutil"
)

var keyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// envdPort is the port E2B's SDKs address the agent on.
const envdPort = "49983"

// daemon is one `cage serve` with its own data and run directories. It may
// be killed and started again on the same directories and ports.
type daemon struct {
	t      *testing.T
	bin    string
	data   string
	runDir string
	api    string // host:port of the control API
	proxy  string // host:port of the sandbox proxy
	flags  []string
	key    string // the first API key, made before the daemon started

	log *testutil.SyncBuffer // every run's output, one after the other

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	created map[string]string // sandbox id -> the key that made it

	http *http.Client
}

// setup skips unless the host can run sandboxes and builds cage.
func setup(t *testing.T) string {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	return filepath.Join(testutil.Binaries(t), "cage")
}

// startDaemon makes the directories and a first API key, starts `cage serve
// --pool 0 FLAGS...` (a --pool in flags wins) on two free loopback ports and
// waits for /health. At the end of the test it kills the sandboxes the test
// made (DELETE), stops the daemon with SIGTERM, removes what is left on the
// host and, if the test failed, prints the daemon's output.
func startDaemon(t *testing.T, flags ...string) *daemon {
	t.Helper()
	bin := setup(t)
	runDir, err := os.MkdirTemp("/run", "cage-daemon-test-")
	if err != nil {
		t.Fatal(err)
	}
	// The sandboxes' root users must be able to traverse it.
	if err := os.Chmod(runDir, 0o711); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testutil.RemoveRunDir(runDir) })
	d := &daemon{
		t: t, bin: bin, data: t.TempDir(), runDir: runDir,
		api: freePort(t), proxy: freePort(t),
		flags:   append([]string{"--pool", "0", "--config", worldConfig(t)}, flags...),
		log:     &testutil.SyncBuffer{},
		created: map[string]string{},
		http:    &http.Client{Timeout: 60 * time.Second},
	}
	d.key = d.createKey(t, "first")
	t.Cleanup(d.cleanup)
	d.start(t)
	return d
}

// worldConfig writes a config file whose resolver is the test world's (the
// sandboxes' outside, see testutil.World) and returns its path.
func worldConfig(t *testing.T) string {
	t.Helper()
	w := testutil.SharedWorld(t)
	p := filepath.Join(t.TempDir(), "cage.json")
	b, _ := json.Marshal(map[string]any{"network": map[string]any{"dns": w.Upstreams()}})
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func (d *daemon) apiURL() string   { return "http://" + d.api }
func (d *daemon) proxyURL() string { return "http://" + d.proxy }

// freePort returns a loopback address nothing listens on (the daemon does
// not report the port it got for :0).
func freePort(t *testing.T) string {
	t.Helper()
	return testutil.FreeLoopback(t)
}

// cageCmd is `cage ARGS...` with cage's own environment variables removed
// and env added.
func (d *daemon) cageCmd(ctx context.Context, env []string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, d.bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAGE_") || strings.HasPrefix(kv, "CAGE_RUNSC=") { // where runsc is, not a setting
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "CAGE_KERNEL_DIR="+testutil.KernelDir()) // where the guest kernel is, not a setting
	cmd.Env = append(cmd.Env, env...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// createKey runs `cage keys create` and returns the key, which must be alone
// on the last line of stdout.
func (d *daemon) createKey(t *testing.T, name string) string {
	t.Helper()
	cmd := d.cageCmd(context.Background(), nil, "keys", "create", "--data", d.data, "--name", name)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cage keys create --data %s: %v\nstdout:\n%s\nstderr:\n%s", d.data, err, out, stderr.Bytes())
	}
	noStack(t, "cage keys create", stderr.String())
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	key := lines[len(lines)-1]
	if !keyRE.MatchString(key) {
		t.Fatalf("cage keys create: the last line of stdout %q is not a key alone (e2b_ + 40 hex); stdout:\n%s", key, out)
	}
	return key
}

// start starts the daemon on d's directories and ports and waits for it to
// answer /health.
func (d *daemon) start(t *testing.T) {
	t.Helper()
	// --debug: the daemon's info lines (created, adopted, removed) are
	// what a failed test needs.
	args := append([]string{"--debug", "--run-dir", d.runDir, "serve", "--data", d.data, "--api", d.api, "--proxy", d.proxy}, d.flags...)
	cmd := d.cageCmd(context.Background(), nil, args...)
	fmt.Fprintf(d.log, "=== %s: cage %s\n", time.Now().Format("15:04:05.000"), strings.Join(args, " "))
	cmd.Stdout, cmd.Stderr = d.log, d.log
	// Should this test process die, the daemon goes too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %v: %v", cmd.Args, err)
	}
	done := make(chan struct{})
	d.mu.Lock()
	d.cmd, d.done, d.waitErr = cmd, done, nil
	d.mu.Unlock()
	go func() {
		err := cmd.Wait()
		d.mu.Lock()
		d.waitErr = err
		d.mu.Unlock()
		close(done)
	}()
	deadline := time.Now().Add(30 * time.Second)
	hc := &http.Client{Timeout: 2 * time.Second}
	for {
		req, _ := http.NewRequest(http.MethodGet, d.apiURL()+"/health", nil)
		resp, err := hc.Do(req)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if verr := apispec.ValidateResponse(req, resp.StatusCode, resp.Header, body); verr != nil {
				t.Errorf("GET /health: %v", verr)
			}
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("status %d: %s", resp.StatusCode, body)
		}
		select {
		case <-done:
			t.Fatalf("cage serve exited before answering /health: %v\n%s", d.exitErr(), d.log.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("cage serve: GET /health not 200 within 30 s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (d *daemon) exitErr() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.waitErr
}

func (d *daemon) running() bool {
	d.mu.Lock()
	done := d.done
	d.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// kill9 kills the daemon with SIGKILL and waits for it to be gone.
func (d *daemon) kill9(t *testing.T) {
	t.Helper()
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
	fmt.Fprintf(d.log, "=== %s: killed with SIGKILL\n", time.Now().Format("15:04:05.000"))
}

// stop sends SIGTERM and requires a clean exit within 10 s.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	if done == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
		if err := d.exitErr(); err != nil {
			t.Errorf("cage serve after SIGTERM: %v (want a clean exit)", err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("cage serve still running 10 s after SIGTERM; killing it")
		_ = cmd.Process.Kill()
		<-done
	}
}

// cleanup kills the test's sandboxes through the API, stops the daemon,
// destroys whatever sandbox of this run directory is still on the host (a
// failed test may leave some) and prints the daemon's output on failure.
func (d *daemon) cleanup() {
	t := d.t
	if d.running() {
		d.mu.Lock()
		ids := make(map[string]string, len(d.created))
		for id, key := range d.created {
			ids[id] = key
		}
		d.mu.Unlock()
		for id, key := range ids {
			req, _ := http.NewRequest(http.MethodDelete, d.apiURL()+"/sandboxes/"+url.PathEscape(id), nil)
			req.Header.Set("X-API-Key", key)
			if resp, err := d.http.Do(req); err == nil {
				resp.Body.Close()
			}
		}
		d.stop(t)
	}
	if left := forceRemoveSandboxes(d.runDir); len(left) > 0 && !t.Failed() {
		t.Errorf("sandboxes still on the host after the test killed its own and stopped the daemon: %v", left)
	}
	logText := d.log.String()
	if strings.Contains(logText, "panic:") || strings.Contains(logText, "goroutine ") {
		t.Errorf("cage serve printed a Go panic or stack trace")
	}
	if t.Failed() {
		t.Logf("cage serve output (data %s, run dir %s):\n%s", d.data, d.runDir, tail(logText, 256<<10))
	}
}

// forceRemoveSandboxes kills every process in the cgroups of the sandboxes
// under runDir/sandboxes and removes their cgroups; it returns their ids.
func forceRemoveSandboxes(runDir string) []string {
	ents, _ := os.ReadDir(filepath.Join(runDir, "sandboxes"))
	var ids []string
	for _, e := range ents {
		ids = append(ids, e.Name())
		dirs := cgroupDirs(e.Name())
		for i := 0; i < 50; i++ {
			pids := 0
			for _, dir := range dirs {
				for _, pid := range readPids(filepath.Join(dir, "cgroup.procs")) {
					pids++
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			if pids == 0 {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		for _, dir := range dirs {
			_ = os.Remove(dir)
		}
	}
	return ids
}

func readPids(file string) []int {
	data, _ := os.ReadFile(file)
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// cgroupDirs lists the cgroup directories of sandbox id that exist, in every
// hierarchy (v1, hybrid or v2).
func cgroupDirs(id string) []string {
	var dirs []string
	for _, pattern := range []string{"/sys/fs/cgroup/*/cage/" + id, "/sys/fs/cgroup/cage/" + id} {
		paths, _ := filepath.Glob(pattern)
		for _, p := range paths {
			if fi, err := os.Stat(p); err == nil && fi.IsDir() {
				dirs = append(dirs, p)
			}
		}
	}
	return dirs
}

// sandboxDirs lists RUN_DIR/sandboxes.
func (d *daemon) sandboxDirs() []string {
	ents, _ := os.ReadDir(filepath.Join(d.runDir, "sandboxes"))
	var ids []string
	for _, e := range ents {
		ids = append(ids, e.Name())
	}
	return ids
}

// checkGone fails unless sandbox id has no state directory and no cgroup
// left, waiting up to wait for them to go.
func (d *daemon) checkGone(t *testing.T, id string, wait time.Duration) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		var left []string
		if _, err := os.Lstat(filepath.Join(d.runDir, "sandboxes", id)); err == nil {
			left = append(left, filepath.Join(d.runDir, "sandboxes", id))
		}
		left = append(left, cgroupDirs(id)...)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("sandbox %s is gone from the API but left on the host: %v", id, left)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// --- the control API ---

// call is one request to the control API.
type call struct {
	method, path string
	key          string // X-API-Key; "" sends none
	body         any    // nil: no body; []byte: sent as is; else JSON
	// invalid marks a request that breaks the document on purpose (bad
	// input tests): it is not checked with ValidateRequest.
	invalid bool
	header  map[string]string
}

// reply is the control API's answer.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) String() string {
	return fmt.Sprintf("%d %s", r.status, bytes.TrimSpace(r.body))
}

// do sends c, checks the request (unless c.invalid) and the response against
// the OpenAPI document, and checks that no error body carries a stack trace.
func (d *daemon) do(t *testing.T, c call) reply {
	t.Helper()
	var body []byte
	switch b := c.body.(type) {
	case nil:
	case []byte:
		body = b
	default:
		var err error
		if body, err = json.Marshal(b); err != nil {
			t.Fatal(err)
		}
	}
	var rd io.Reader
	if c.body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(c.method, d.apiURL()+c.path, rd)
	if err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, err)
	}
	if c.key != "" {
		req.Header.Set("X-API-Key", c.key)
	}
	if c.body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range c.header {
		req.Header.Set(k, v)
	}
	if !c.invalid {
		if err := apispec.ValidateRequest(req, body); err != nil {
			t.Errorf("the test's own request breaks the document: %v", err)
		}
	}
	resp, err := d.http.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: read the body: %v", c.method, c.path, err)
	}
	r := reply{status: resp.StatusCode, header: resp.Header, body: data}
	if err := apispec.ValidateResponse(req, r.status, r.header, data); err != nil {
		t.Errorf("%s %s: %v", c.method, c.path, err)
	}
	noStack(t, c.method+" "+c.path+" response", string(data))
	if r.status >= 400 {
		checkErrorBody(t, c.method+" "+c.path, r)
	}
	return r
}

// expect does c and fails unless the status is want; it returns the reply.
func (d *daemon) expect(t *testing.T, want int, c call) reply {
	t.Helper()
	r := d.do(t, c)
	if r.status != want {
		t.Errorf("%s %s: got %v, want status %d", c.method, c.path, r, want)
	}
	return r
}

// decode unmarshals the reply's body into v.
func (r reply) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decode %q: %v", r.body, err)
	}
}

// checkErrorBody checks an error reply is E2B's {code, message} with code
// equal to the status and a message.
func checkErrorBody(t *testing.T, what string, r reply) {
	t.Helper()
	var e struct {
		Code    *int    `json:"code"`
		Message *string `json:"message"`
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("%s: error %d with Content-Type %q, want application/json", what, r.status, ct)
	}
	if err := json.Unmarshal(r.body, &e); err != nil || e.Code == nil || e.Message == nil {
		t.Errorf("%s: error %d body %q is not {code, message}", what, r.status, r.body)
		return
	}
	if *e.Code != r.status || *e.Message == "" {
		t.Errorf("%s: error body %q: want code %d and a message", what, r.body, r.status)
	}
}

// noStack fails if s looks like it holds a Go panic or stack trace.
func noStack(t *testing.T, what, s string) {
	t.Helper()
	for _, sign := range []string{"goroutine ", "panic:", "runtime/debug", ".go:"} {
		if strings.Contains(s, sign) {
			t.Errorf("%s holds a Go stack trace or source location (%q):\n%s", what, sign, tail(s, 4096))
			return
		}
	}
}

// create makes a sandbox with POST /v2/sandboxes and body (templateID
// "host" and timeout 300 unless body says otherwise), remembering it for
// cleanup.
func (d *daemon) create(t *testing.T, key string, body map[string]any) types.Sandbox {
	t.Helper()
	if body == nil {
		body = map[string]any{}
	}
	if _, ok := body["templateID"]; !ok {
		body["templateID"] = "host"
	}
	if _, ok := body["timeout"]; !ok {
		body["timeout"] = 300
	}
	r := d.do(t, call{method: "POST", path: "/v2/sandboxes", key: key, body: body})
	if r.status != http.StatusCreated {
		t.Fatalf("POST /v2/sandboxes %v: %v", body, r)
	}
	var sb types.Sandbox
	r.decode(t, &sb)
	d.remember(sb.SandboxID, key)
	return sb
}

func (d *daemon) remember(id, key string) {
	d.mu.Lock()
	d.created[id] = key
	d.mu.Unlock()
}

// get returns GET /sandboxes/{id}, which must be 200.
func (d *daemon) get(t *testing.T, key, id string) types.SandboxDetail {
	t.Helper()
	r := d.do(t, call{method: "GET", path: "/sandboxes/" + id, key: key})
	if r.status != http.StatusOK {
		t.Fatalf("GET /sandboxes/%s: %v", id, r)
	}
	var l types.SandboxDetail
	r.decode(t, &l)
	return l
}

// list returns every sandbox GET /v2/sandboxes lists for key with query q,
// following X-Next-Token.
func (d *daemon) list(t *testing.T, key string, q url.Values) []types.ListedSandbox {
	t.Helper()
	if q == nil {
		q = url.Values{}
	}
	var all []types.ListedSandbox
	for pages := 0; ; pages++ {
		if pages > 1000 {
			t.Fatalf("GET /v2/sandboxes: more than 1000 pages")
		}
		path := "/v2/sandboxes"
		if len(q) > 0 {
			path += "?" + q.Encode()
		}
		r := d.do(t, call{method: "GET", path: path, key: key})
		if r.status != http.StatusOK {
			t.Fatalf("GET %s: %v", path, r)
		}
		var page []types.ListedSandbox
		r.decode(t, &page)
		all = append(all, page...)
		next := r.header.Get("X-Next-Token")
		if next == "" {
			return all
		}
		q.Set("nextToken", next)
	}
}

func (d *daemon) kill(t *testing.T, key, id string) {
	t.Helper()
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/sandboxes/" + id, key: key})
}

// --- the proxy ---

// agent returns a client of sandbox id's agent through the proxy, routed by
// E2B's headers.
func (d *daemon) agent(id, token string) *agentclient.Client {
	h := http.Header{}
	h.Set("E2b-Sandbox-Id", id)
	h.Set("E2b-Sandbox-Port", envdPort)
	return agentclient.NewWithHeaders(d.dialProxy, token, h)
}

func (d *daemon) dialProxy(ctx context.Context) (net.Conn, error) {
	var dl net.Dialer
	return dl.DialContext(ctx, "tcp", d.proxy)
}

// hostAgent returns a client of sandbox id's agent through the proxy, routed
// by the Host {port}-{id}.{domain}; the connection still goes to the proxy.
func (d *daemon) hostAgent(t *testing.T, id, token, domain string) *agentclient.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols:   &p,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return d.dialProxy(ctx) },
	}
	t.Cleanup(tr.CloseIdleConnections)
	host := envdPort + "-" + id + "." + domain
	hc := &http.Client{Transport: roundTripper(func(r *http.Request) (*http.Response, error) {
		r = r.Clone(r.Context())
		r.Host = host
		if token != "" {
			r.Header.Set("X-Access-Token", token)
		}
		return tr.RoundTrip(r)
	})}
	base := "http://" + host
	return &agentclient.Client{
		Process: processconnect.NewProcessClient(hc, base),
		FS:      filesystemconnect.NewFilesystemClient(hc, base),
		HTTP:    hc,
	}
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// runResult is how a command in a sandbox went.
type runResult struct {
	stdout, stderr string
	exit           int32
	err            error
}

// run runs `sh -c script` in the sandbox through ac, for up to a minute.
func run(ac *agentclient.Client, script string) runResult {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &errb})
	r := runResult{stdout: out.String(), stderr: errb.String(), err: err}
	if end != nil {
		r.exit = end.GetExitCode()
	}
	return r
}

// mustRun runs script and fails unless it exits 0; it returns stdout.
func mustRun(t *testing.T, ac *agentclient.Client, script string) string {
	t.Helper()
	r := run(ac, script)
	if r.err != nil || r.exit != 0 {
		t.Fatalf("sh -c %q in the sandbox: exit %d, err %v, stderr %q", script, r.exit, r.err, r.stderr)
	}
	return r.stdout
}

// upload writes data to path in the sandbox with POST /files.
func upload(t *testing.T, ac *agentclient.Client, path string, data []byte) {
	t.Helper()
	q := url.Values{"path": {path}, "username": {"user"}}
	req, _ := http.NewRequest(http.MethodPost, agentclient.BaseURL+"/files?"+q.Encode(), bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := ac.HTTP.Do(req)
	if err != nil {
		t.Fatalf("POST /files?path=%s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /files?path=%s: %d %s", path, resp.StatusCode, body)
	}
}

// download reads path in the sandbox with GET /files.
func download(t *testing.T, ac *agentclient.Client, path string) []byte {
	t.Helper()
	q := url.Values{"path": {path}, "username": {"user"}}
	req, _ := http.NewRequest(http.MethodGet, agentclient.BaseURL+"/files?"+q.Encode(), nil)
	resp, err := ac.HTTP.Do(req)
	if err != nil {
		t.Fatalf("GET /files?path=%s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /files?path=%s: %d %s", path, resp.StatusCode, body)
	}
	return body
}

func isUnauthenticated(err error) bool {
	return err != nil && connect.CodeOf(err) == connect.CodeUnauthenticated
}

// --- host state ---

// proc is what /proc says of one process.
type proc struct {
	pid, ppid, uid int
	nspid          []int
	cgroup         string // the sandbox id of its cage cgroup, "" if none
	comm           string
}

// pid1 reports whether the process is PID 1 of its own PID namespace (a
// sandbox's agent).
func (p proc) pid1() bool { return len(p.nspid) > 1 && p.nspid[len(p.nspid)-1] == 1 }

var cageGroupRE = regexp.MustCompile(`^/cage/([^/]+)`)

// readProc reads /proc/PID; ok is false when the process is gone.
func readProc(pid int) (proc, bool) {
	p := proc{pid: pid, uid: -1}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return p, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, _ := strings.Cut(line, ":")
		f := strings.Fields(v)
		switch k {
		case "Name":
			p.comm = strings.TrimSpace(v)
		case "PPid":
			p.ppid, _ = strconv.Atoi(strings.TrimSpace(v))
		case "Uid":
			if len(f) > 0 {
				p.uid, _ = strconv.Atoi(f[0])
			}
		case "NSpid":
			for _, s := range f {
				n, _ := strconv.Atoi(s)
				p.nspid = append(p.nspid, n)
			}
		}
	}
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	for _, line := range strings.Split(string(cg), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if m := cageGroupRE.FindStringSubmatch(parts[2]); m != nil {
			p.cgroup = m[1]
			if strings.Contains(","+parts[1]+",", ",pids,") {
				break // the pids hierarchy decides
			}
		}
	}
	return p, true
}

// sandboxProcs lists the processes whose uid is in the sandboxes' host uid
// ranges (from 1<<20).
func sandboxProcs() map[int]proc {
	ents, _ := os.ReadDir("/proc")
	out := map[int]proc{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if p, ok := readProc(pid); ok && p.uid >= 1<<20 {
			out[pid] = p
		}
	}
	return out
}

// unixSockets maps the inodes of unix sockets bound under dir to their
// paths (from /proc/net/unix of this network namespace, where the daemon
// binds each agent's socket before handing it over).
func unixSockets(dir string) map[string]string {
	data, _ := os.ReadFile("/proc/net/unix")
	out := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 8 && strings.HasPrefix(f[7], dir+"/") {
			out[f[6]] = f[7]
		}
	}
	return out
}

// socketOwner returns the path of a socket under dir that pid holds, if any.
func socketOwner(pid int, sockets map[string]string) string {
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err != nil {
			continue
		}
		if inode, ok := strings.CutPrefix(link, "socket:["); ok {
			if p, ok := sockets[strings.TrimSuffix(inode, "]")]; ok {
				return p
			}
		}
	}
	return ""
}

// --- small things ---

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// eventually polls cond every 50 ms until it returns "" or wait passes, and
// returns its last answer.
func eventually(wait time.Duration, cond func() string) string {
	deadline := time.Now().Add(wait)
	for {
		why := cond()
		if why == "" || time.Now().After(deadline) {
			return why
		}
		time.Sleep(50 * time.Millisecond)
	}
}
