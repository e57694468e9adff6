// Package e2b runs the real E2B JS SDK, as published on npm, against
// `cage serve`: the SDK is pointed at the daemon with E2B_API_URL and
// E2B_SANDBOX_URL, and node:test suites (sdk.test.mjs, sdk.long.test.mjs)
// drive sandboxes through it. Two SDK releases run: 2.51.0 and 2.46.1
// (package alias e2b-246), which still creates with POST /sandboxes.
//
// Needs root, node and npm; scripts/test.sh runs `npm ci` here first
// (package-lock.json pins the SDK); the tests themselves reach only loopback.
package e2b

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// sdkModules are the npm names of the SDK releases under test (package.json).
var sdkModules = []string{"e2b", "e2b-246"}

// longModule is the one release that also runs sdk.long.test.mjs (over a
// minute), to keep CI time down.
const longModule = "e2b"

var keyRE = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// TestE2BSDK runs sdk.test.mjs once per SDK release against one daemon.
func TestE2BSDK(t *testing.T) {
	d := startDaemon(t)
	dir := sdkDir(t)
	for _, mod := range sdkModules {
		t.Run(mod, func(t *testing.T) {
			files := []string{"sdk.test.mjs"}
			env := d.sdkEnv(mod, d.key)
			if mod == longModule {
				files = append(files, "sdk.long.test.mjs")
				env = append(env, "E2B_LONG=1")
			}
			args := append([]string{"--test", "--test-reporter=spec"}, files...)
			if err := runNode(t, dir, env, 10*time.Minute, args...); err != nil {
				t.Errorf("E2B SDK %s suite failed: %v (the daemon's log follows the test)", mod, err)
			}
		})
	}
	d.checkNoSandboxesLeft(t)
	d.stop(t)
}

// TestE2BSDKOtherWalls runs the SDK suite (2.51.0) against daemons whose
// sandboxes are on the runc and gVisor walls: the agent and its protocol are
// the same on every wall, and so must be what the SDK sees.
//
// On the microvm wall the suite's sandboxes start from base (no VM is given
// the host's files), so it runs where scripts/test.sh built base.
func TestE2BSDKOtherWalls(t *testing.T) {
	for _, wall := range []string{"runc", "gvisor", "microvm"} {
		t.Run(wall, func(t *testing.T) {
			requireWall(t, wall)
			d := startDaemon(t, "--wall", wall)
			if wall == "microvm" {
				d.template = "base"
			}
			dir := sdkDir(t)
			args := []string{"--test", "--test-reporter=spec", "sdk.test.mjs"}
			if err := runNode(t, dir, d.sdkEnv("e2b", d.key), 10*time.Minute, args...); err != nil {
				t.Errorf("E2B SDK suite on the %s wall failed: %v (the daemon's log follows the test)", wall, err)
			}
			d.checkNoSandboxesLeft(t)
			d.stop(t)
		})
	}
}

// requireWall skips (or, where CAGE_REQUIRE_WALLS names the wall, fails) a
// test of a wall whose runtime this machine lacks.
func requireWall(t *testing.T, wall string) {
	t.Helper()
	if wall == "microvm" {
		// QEMU and the guest kernel (scripts/kernel.sh), and base.
		_, qerr := exec.LookPath("qemu-system-x86_64")
		_, kerr := os.Stat(filepath.Join(testutil.KernelDir(), "current"))
		if qerr == nil && kerr == nil && baseTemplate() == "1" {
			return
		}
		testutil.SkipWall(t, wall, "QEMU, the guest kernel (scripts/kernel.sh) or the base template is missing")
	}
	bin := map[string]string{"runc": "runc", "gvisor": "runsc"}[wall]
	if wall == "gvisor" && os.Getenv("CAGE_RUNSC") != "" {
		if _, err := os.Stat(os.Getenv("CAGE_RUNSC")); err == nil {
			return
		}
	}
	if _, err := exec.LookPath(bin); err == nil {
		return
	}
	testutil.SkipWall(t, wall, "%s is not installed", bin)
}

// badKeyScript creates a sandbox and lists sandboxes with the (wrong) key in
// E2B_API_KEY; both must reject with the SDK's AuthenticationError.
const badKeyScript = `
const { Sandbox, AuthenticationError } = await import(process.env.E2B_SDK_MODULE)
let bad = 0
async function expectAuthError(what, fn) {
  try {
    const r = await fn()
    console.log('FAIL ' + what + ' succeeded with a wrong key: ' + JSON.stringify(r?.sandboxId ?? r))
    if (r?.kill) await r.kill().catch(() => {})
    bad++
  } catch (e) {
    if (e instanceof AuthenticationError) {
      console.log('ok ' + what + ': AuthenticationError: ' + e.message)
    } else {
      console.log('FAIL ' + what + ': want AuthenticationError, got ' + e?.constructor?.name + ': ' + e?.message)
      bad++
    }
  }
}
await expectAuthError('Sandbox.create', () => Sandbox.create('host', { timeoutMs: 60000 }))
await expectAuthError('Sandbox.list', () => Sandbox.list().nextItems())
process.exit(bad ? 1 : 0)
`

// TestE2BSDKBadKey checks that a key the daemon never issued is refused with
// 401, which the SDK raises as AuthenticationError.
func TestE2BSDKBadKey(t *testing.T) {
	d := startDaemon(t)
	dir := sdkDir(t)
	wrong := make([]byte, 20)
	_, _ = rand.Read(wrong)
	key := "e2b_" + hex.EncodeToString(wrong)
	for _, mod := range sdkModules {
		t.Run(mod, func(t *testing.T) {
			if err := runNode(t, dir, d.sdkEnv(mod, key), 2*time.Minute, "--input-type=module", "-e", badKeyScript); err != nil {
				t.Errorf("E2B SDK %s with a wrong key: %v", mod, err)
			}
		})
	}
	d.checkNoSandboxesLeft(t)
	d.stop(t)
}

// daemon is one `cage serve` with its own data and run directories.
type daemon struct {
	cmd      *exec.Cmd
	apiURL   string
	proxyURL string
	key      string
	log      *testutil.SyncBuffer
	done     chan struct{} // closed when cmd has exited
	waitErr  error
	stopped  bool
	template string // what the suite's sandboxes start from ("": host)
	data     string // its data directory (more keys: cage keys create --data)
}

// startDaemon skips unless this host can run the suite, builds cage, makes
// an API key, starts `cage serve` on two free loopback ports and waits for
// /health. Its log is printed if the test fails.
func startDaemon(t *testing.T, extra ...string) *daemon {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	requireNode(t)

	bin := filepath.Join(testutil.Binaries(t), "cage")
	data := t.TempDir()
	runDir, err := os.MkdirTemp("/run", "cage-e2b-")
	if err != nil {
		t.Fatal(err)
	}
	// The sandboxes' root users must be able to traverse it.
	if err := os.Chmod(runDir, 0o711); err != nil {
		t.Fatal(err)
	}
	// Registered first so that it runs after the daemon is gone.
	t.Cleanup(func() { testutil.RemoveRunDir(runDir) })

	keys := cageCommand(context.Background(), bin, "keys", "create", "--data", data, "--name", "e2b-sdk-test")
	var keysErr bytes.Buffer
	keys.Stderr = &keysErr
	out, err := keys.Output()
	if err != nil {
		t.Fatalf("cage keys create --data %s: %v\nstdout:\n%s\nstderr:\n%s", data, err, out, keysErr.Bytes())
	}
	key := lastLine(string(out))
	if !keyRE.MatchString(key) {
		t.Fatalf("cage keys create: last line of stdout %q is not a key (e2b_ + 40 hex); stdout:\n%s\nstderr:\n%s", key, out, keysErr.Bytes())
	}

	// The test image as template "cage-test" (an image template through
	// the SDK).
	imp := cageCommand(context.Background(), bin, "template", "import", "--data", data,
		testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest"), "cage-test")
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		// The daemon uses the shared store (below): import there.
		imp.Args = slices.DeleteFunc(imp.Args, func(a string) bool { return a == "--data" || a == data })
		imp.Env = append(imp.Env, "CAGE_TEMPLATES="+dir)
	}
	if out, err := imp.CombinedOutput(); err != nil {
		t.Fatalf("cage template import: %v\n%s", err, out)
	}

	api, proxy := freePort(t), freePort(t)
	// "{proxy-port}" in a flag is the proxy's port (a domain with its port).
	_, proxyPort, _ := net.SplitHostPort(proxy)
	for i := range extra {
		extra[i] = strings.ReplaceAll(extra[i], "{proxy-port}", proxyPort)
	}
	scheme := "http://"
	if slices.Contains(extra, "--tls-self-signed") {
		scheme = "https://" // the SDK trusts the daemon's CA (NODE_EXTRA_CA_CERTS)
	}
	d := &daemon{
		apiURL:   "http://" + api,
		proxyURL: scheme + proxy,
		key:      key,
		data:     data,
		log:      &testutil.SyncBuffer{},
		done:     make(chan struct{}),
	}
	// The sandboxes' outside is the test world (see testutil.World).
	world := testutil.SharedWorld(t)
	config := filepath.Join(t.TempDir(), "cage.json")
	cfgMap := map[string]any{"network": map[string]any{"dns": world.Upstreams()}}
	// The shared template store (scripts/test.sh builds "base" there).
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		cfgMap["templates"] = dir
	}
	cfgJSON, _ := json.Marshal(cfgMap)
	if err := os.WriteFile(config, cfgJSON, 0o600); err != nil {
		t.Fatal(err)
	}
	d.cmd = cageCommand(context.Background(), bin, append([]string{"serve", "--config", config,
		"--api", api, "--proxy", proxy, "--data", data, "--run-dir", runDir}, extra...)...)
	d.cmd.Stdout = d.log
	d.cmd.Stderr = d.log
	// Should this test process die, the daemon stops too.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start %v: %v", d.cmd.Args, err)
	}
	go func() {
		d.waitErr = d.cmd.Wait()
		close(d.done)
	}()
	t.Cleanup(func() {
		if !d.stopped {
			_ = d.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-d.done:
			case <-time.After(10 * time.Second):
				_ = d.cmd.Process.Kill()
				<-d.done
			}
		}
		if t.Failed() {
			t.Logf("cage serve log (%s):\n%s", strings.Join(d.cmd.Args, " "), lastBytes(d.log.String(), 1<<20))
		}
	})

	deadline := time.Now().Add(30 * time.Second)
	client := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := client.Get(d.apiURL + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		select {
		case <-d.done:
			t.Fatalf("cage serve exited before answering /health: %v", d.waitErr)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("cage serve: GET %s/health not 200 within 30 s: %v", d.apiURL, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("cage serve: API %s, sandboxes %s", d.apiURL, d.proxyURL)
	return d
}

// sdkEnv is the environment the SDK runs in: this process's, less any E2B_
// or CAGE_ settings, pointed at the daemon with the given key.
func (d *daemon) sdkEnv(module, key string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "E2B_") && !strings.HasPrefix(kv, "CAGE_") {
			env = append(env, kv)
		}
	}
	return append(env,
		"E2B_API_URL="+d.apiURL,
		"E2B_SANDBOX_URL="+d.proxyURL,
		"E2B_API_KEY="+key,
		"E2B_SDK_MODULE="+module,
		// The test world's hosts (see testutil.World), for the network tests.
		"CAGE_TEST_PUBLIC_HOST="+testutil.PublicHost.String(),
		"CAGE_TEST_BASE="+baseTemplate(),
		"CAGE_TEST_TEMPLATE="+d.template,
		"CAGE_TEST_OTHER_HOST="+testutil.OtherHost.String(),
		// Loopback never goes through a proxy the host may configure.
		"NO_PROXY=127.0.0.1,localhost",
		"no_proxy=127.0.0.1,localhost",
	)
}

// checkNoSandboxesLeft fails the test if the daemon still lists sandboxes
// (every SDK test kills what it made) and kills them.
func (d *daemon) checkNoSandboxesLeft(t *testing.T) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, d.apiURL+"/v2/sandboxes?state=running,paused", nil)
	req.Header.Set("X-API-Key", d.key)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Errorf("list sandboxes after the SDK tests: %v", err)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /v2/sandboxes after the SDK tests: %s: %s", resp.Status, body)
		return
	}
	var left []struct {
		SandboxID string            `json:"sandboxID"`
		Metadata  map[string]string `json:"metadata"`
	}
	if err := json.Unmarshal(body, &left); err != nil {
		t.Errorf("GET /v2/sandboxes after the SDK tests: %v: %s", err, body)
		return
	}
	for _, s := range left {
		t.Errorf("sandbox %s (metadata %v) still listed after the SDK tests killed theirs", s.SandboxID, s.Metadata)
		req, _ := http.NewRequest(http.MethodDelete, d.apiURL+"/sandboxes/"+s.SandboxID, nil)
		req.Header.Set("X-API-Key", d.key)
		resp, err := (&http.Client{Timeout: time.Minute}).Do(req)
		if err != nil {
			t.Errorf("DELETE /sandboxes/%s: %v", s.SandboxID, err)
			continue
		}
		resp.Body.Close()
	}
}

// stop sends SIGTERM and requires the daemon to exit within 10 s.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	d.stopped = true
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Errorf("SIGTERM cage serve: %v", err)
	}
	select {
	case <-d.done:
		if d.waitErr != nil {
			t.Errorf("cage serve after SIGTERM: %v (want a clean exit)", d.waitErr)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("cage serve still running 10 s after SIGTERM; killing it")
		_ = d.cmd.Process.Kill()
		<-d.done
	}
}

// cageCommand is bin ARGS with cage's own environment variables removed,
// but for where runsc and the guest kernel are, which are no settings.
func cageCommand(ctx context.Context, bin string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CAGE_") || strings.HasPrefix(kv, "CAGE_RUNSC=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "CAGE_KERNEL_DIR="+testutil.KernelDir())
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// requireNode skips unless node (20 or later, as the SDK needs) and npm run;
// where scripts/test.sh ran (CAGE_REQUIRE_E2B=1) their absence fails.
func requireNode(t *testing.T) {
	t.Helper()
	skip := t.Skipf
	if os.Getenv("CAGE_REQUIRE_E2B") == "1" {
		skip = t.Fatalf
	}
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			skip("SKIP: needs %s on PATH to run the E2B JS SDK: %v", tool, err)
			return
		}
	}
	out, err := exec.Command("node", "--version").Output()
	if err != nil {
		skip("SKIP: node --version: %v", err)
		return
	}
	v := strings.TrimPrefix(strings.TrimSpace(string(out)), "v")
	major, _ := strconv.Atoi(strings.SplitN(v, ".", 2)[0])
	if major < 20 {
		skip("SKIP: node %s is too old for the E2B SDK (needs 20.18.1 or later)", v)
	}
}

// sdkDir is this package's directory, whose node_modules must match
// package-lock.json. The tests cannot install it themselves: they run in
// a network namespace of their own, where the registry does not resolve.
// scripts/test.sh runs `npm ci` beforehand and leaves a stamp,
// `sha256sum package.json package-lock.json`, in node_modules.
func sdkDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(testutil.RepoRoot(), "test", "e2b")
	var want strings.Builder
	for _, name := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&want, "%x  %s\n", sha256.Sum256(b), name)
	}
	got, _ := os.ReadFile(filepath.Join(dir, "node_modules", ".cage-lock-sha256"))
	upToDate := string(got) == want.String()
	for _, mod := range sdkModules {
		if _, err := os.Stat(filepath.Join(dir, "node_modules", mod, "package.json")); err != nil {
			upToDate = false
		}
	}
	if !upToDate {
		t.Fatalf("test/e2b/node_modules is missing or older than package-lock.json: run scripts/test.sh (it runs `npm ci` there, outside the tests' network namespace)")
	}
	return dir
}

// runNode runs node ARGS in dir with env, logging its output line by line
// as it comes, and returns its failure.
func runNode(t *testing.T, dir string, env []string, limit time.Duration, args ...string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", args...)
	cmd.Dir = dir
	cmd.Env = env
	cmd.WaitDelay = 5 * time.Second
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	cmd.Stdout = w
	cmd.Stderr = w
	if err := cmd.Start(); err != nil {
		r.Close()
		w.Close()
		return err
	}
	w.Close()
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			t.Log(sc.Text())
		}
	}()
	err = cmd.Wait()
	r.Close()
	<-scanned
	if ctx.Err() != nil {
		return fmt.Errorf("node ran past %v: %w", limit, err)
	}
	return err
}

// badPorts are the ports fetch refuses to connect to (fetch.spec.whatwg.org
// "bad port"); the SDK's undici would fail with "bad port" on them.
var badPorts = map[int]bool{
	1: true, 7: true, 9: true, 11: true, 13: true, 15: true, 17: true, 19: true, 20: true, 21: true,
	22: true, 23: true, 25: true, 37: true, 42: true, 43: true, 53: true, 69: true, 77: true, 79: true,
	87: true, 95: true, 101: true, 102: true, 103: true, 104: true, 109: true, 110: true, 111: true,
	113: true, 115: true, 117: true, 119: true, 123: true, 135: true, 137: true, 139: true, 143: true,
	161: true, 179: true, 389: true, 427: true, 465: true, 512: true, 513: true, 514: true, 515: true,
	526: true, 530: true, 531: true, 532: true, 540: true, 548: true, 554: true, 556: true, 563: true,
	587: true, 601: true, 636: true, 989: true, 990: true, 993: true, 995: true, 1719: true, 1720: true,
	1723: true, 2049: true, 3659: true, 4045: true, 4190: true, 5060: true, 5061: true, 6000: true,
	6566: true, 6665: true, 6666: true, 6667: true, 6668: true, 6669: true, 6679: true, 6697: true,
	10080: true,
}

// freePort returns 127.0.0.1:PORT for a port that was free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	for range 20 {
		addr := testutil.FreeLoopback(t)
		_, p, _ := net.SplitHostPort(addr)
		if port, _ := strconv.Atoi(p); !badPorts[port] {
			return addr
		}
	}
	t.Fatal("no free loopback port outside fetch's bad-port list")
	return ""
}

// lastLine is the last non-blank line of s, trimmed.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}

// lastBytes is the last n bytes of s.
func lastBytes(s string, n int) string {
	if len(s) > n {
		return "[...]\n" + s[len(s)-n:]
	}
	return s
}

// baseTemplate says whether the shared template store has "base" ("1"), so
// that the SDK suite tests python3 and node in it; where scripts/test.sh
// built it (CAGE_REQUIRE_BASE) it must be there.
func baseTemplate() string {
	dir := os.Getenv("CAGE_TEMPLATES")
	if dir == "" {
		return ""
	}
	if _, err := os.Stat(filepath.Join(dir, "templates", "base.json")); err != nil {
		if os.Getenv("CAGE_REQUIRE_BASE") != "" {
			panic("CAGE_REQUIRE_BASE: the template store " + dir + " has no base template")
		}
		return ""
	}
	return "1"
}
