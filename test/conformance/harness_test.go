// Package conformance is the behaviour suite every wall must pass: the agent
// protocol, limits, exit reasons, hostile workloads and teardown. Each test
// runs once per wall available on this machine; a wall that is missing is
// skipped with the reason printed.
package conformance

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	cagewall "github.com/cagehq/cage/internal/wall"
	"github.com/cagehq/cage/internal/wall/microvm"
)

// wall is one isolation tier under test.
type wall struct {
	name string
	// newBox creates a sandbox on this wall; the test's cleanup destroys it.
	newBox func(t *testing.T, o sandbox.Options) *box
}

// box is a live sandbox seen by a test.
type box struct {
	*agentclient.Client
	sb cagewall.Sandbox
	t  *testing.T
}

var (
	hostOnce sync.Once
	host     *sandbox.Host
	hostErr  error
	hostDir  string
)

func TestMain(m *testing.M) {
	// In a network namespace of its own: the network tests build their
	// outside there, and nothing they do reaches the machine's network.
	code := testutil.InOwnNetwork(m)
	if hostDir != "" {
		testutil.RemoveRunDir(hostDir)
	}
	os.Exit(code)
}

func processHost(t testing.TB) *sandbox.Host {
	testutil.RequireRoot(t)
	testutil.RequireKernelFeature(t, testutil.UserNamespaces)
	testutil.RequireKernelFeature(t, testutil.MountAPI)
	testutil.RequireKernelFeature(t, testutil.Cgroups)
	bin := testutil.Binaries(t)
	hostOnce.Do(func() {
		dir, err := os.MkdirTemp("/run", "cage-conformance-")
		if err != nil {
			hostErr = err
			return
		}
		hostDir = dir
		_ = os.Chmod(dir, 0o711)
		// Warnings go to stderr, which `go test` shows when the package
		// fails: a microVM's stall report (its virtio queues, taken while
		// the guest hangs) is then beside the test that met the hang.
		host, hostErr = sandbox.NewHost(dir, filepath.Join(bin, "cage-agent"),
			slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
		if hostErr == nil {
			host.KernelDir = testutil.KernelDir()
			// As the daemon runs it: the process wall's agents come from
			// the spawner (cage run's direct fork is the CLI tests').
			host.SpawnAgents = true
		}
		if hostErr == nil {
			// The shared store where scripts/test.sh built "base", else
			// one of the run's own.
			store := os.Getenv("CAGE_TEMPLATES")
			if store == "" {
				store = filepath.Join(dir, "data", "templates")
			}
			host.Templates, hostErr = imgstore.Open(store)
		}
	})
	if hostErr != nil {
		t.Fatal(hostErr)
	}
	return host
}

// walls lists the walls this suite runs on: every wall cage has. A wall
// whose runtime this machine lacks is skipped with the reason printed (CI
// installs them all: runc from Debian, runsc built by scripts/test.sh).
func walls() []wall {
	var ws []wall
	for _, name := range sandbox.Walls {
		name := name
		ws = append(ws, wall{
			name: name,
			newBox: func(t *testing.T, o sandbox.Options) *box {
				h := processHost(t)
				if err := h.WallMissing(name); err != nil {
					testutil.SkipWall(t, name, "%v", err)
				}
				if name == "microvm" && o.Template == "" {
					requireBase(t, h)
				}
				o.Wall = name
				testPools(t, h, name)
				sb, err := h.Create(context.Background(), o)
				if err != nil {
					t.Fatalf("create sandbox on %s: %v", name, err)
				}
				c := agentclient.New(sb.Dial, sb.Token())
				t.Cleanup(func() {
					c.Close()
					if err := sb.Destroy(); err != nil {
						t.Errorf("destroy: %v", err)
					}
				})
				return &box{Client: c, sb: sb, t: t}
			},
		})
	}
	return ws
}

// testPools keeps a pool of the wall's default template on h when
// CAGE_TEST_POOLS is a number of sandboxes (the suite then runs with pools
// on: `CAGE_TEST_POOLS=2 go test ./test/conformance`); creates that fit
// take their sandbox from it. The pool starts at the wall's first create.
func testPools(t *testing.T, h *sandbox.Host, wallName string) {
	n, _ := strconv.Atoi(os.Getenv("CAGE_TEST_POOLS"))
	if n <= 0 {
		return
	}
	netHost(t) // the pool's networks reach the test's world
	if err := h.AddWallPool(wallName, h.DefaultTemplate(wallName), n); err != nil {
		t.Fatalf("CAGE_TEST_POOLS: a pool on %s: %v", wallName, err)
	}
}

// requireBase skips unless the store has the base template, which a
// microvm sandbox starts from unless it names another (scripts/test.sh
// builds it, and says so with CAGE_REQUIRE_BASE, which makes its absence
// a failure).
func requireBase(t *testing.T, h *sandbox.Host) {
	t.Helper()
	if h.Templates != nil {
		if _, err := h.Templates.Get(microvm.DefaultTemplate); err == nil {
			return
		}
	}
	if os.Getenv("CAGE_REQUIRE_BASE") != "" {
		t.Fatalf("CAGE_REQUIRE_BASE: no %s template in the store", microvm.DefaultTemplate)
	}
	t.Skipf("SKIP wall microvm: no %s template (make base)", microvm.DefaultTemplate)
}

// forEachWall runs fn as a subtest per wall.
func forEachWall(t *testing.T, fn func(t *testing.T, w wall)) {
	for _, w := range walls() {
		t.Run(w.name, func(t *testing.T) { fn(t, w) })
	}
}

// result is how a command went.
type result struct {
	stdout, stderr string
	end            *pb.ProcessEvent_EndEvent
	err            error
}

func (r result) code() int32 {
	if r.end == nil {
		return -999
	}
	return r.end.GetExitCode()
}

// sh runs a shell command (as E2B's commands.run does) and returns its result.
func (b *box) sh(script string, mods ...func(*agentclient.RunOptions)) result {
	return b.run(append([]func(*agentclient.RunOptions){func(o *agentclient.RunOptions) {
		o.Cmd, o.Args = "/bin/bash", []string{"-l", "-c", script}
	}}, mods...)...)
}

func (b *box) run(mods ...func(*agentclient.RunOptions)) result {
	b.t.Helper()
	var out, errb bytes.Buffer
	o := agentclient.RunOptions{Stdout: &out, Stderr: &errb}
	for _, m := range mods {
		m(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	end, err := b.Run(ctx, o)
	return result{stdout: out.String(), stderr: errb.String(), end: end, err: err}
}

func asUser(u string) func(*agentclient.RunOptions) {
	return func(o *agentclient.RunOptions) { o.User = u }
}

func withStdin(r io.Reader) func(*agentclient.RunOptions) {
	return func(o *agentclient.RunOptions) { o.Stdin = r }
}

func withTimeout(d time.Duration) func(*agentclient.RunOptions) {
	return func(o *agentclient.RunOptions) { o.TimeoutMs = uint32(d.Milliseconds()) }
}

// mustSh runs script and fails the test unless it exits 0.
func (b *box) mustSh(script string, mods ...func(*agentclient.RunOptions)) string {
	b.t.Helper()
	r := b.sh(script, mods...)
	if r.err != nil || r.code() != 0 {
		b.t.Fatalf("%q: err=%v code=%d stdout=%q stderr=%q", script, r.err, r.code(), r.stdout, r.stderr)
	}
	return r.stdout
}

// agentArgv is how PID 1's command line reads on a wall (space-joined): the
// process wall forks cage-agent init, the OCI walls run cage-agent serve
// from where the bundle mounts it.
func agentArgv(wall string) string {
	switch wall {
	case "process":
		return "cage-agent init"
	case "microvm":
		// The guest's agent, which its init (the initramfs's /init, outside
		// the sandbox's PID namespace) starts.
		return "cage-agent guest"
	}
	return "/run/cage-agent serve"
}

// imageRoot reports whether a wall's sandboxes start from an image
// template when they name none: the microvm wall's default is base (no VM
// is given the host's files). An image's root is the sandbox's own
// writable overlay: root inside may change it, and what it writes stays in
// that sandbox (TestImageTemplate checks both on every wall); the user may
// not. The host template's root is read-only for root too.
func imageRoot(wall string) bool { return wall == "microvm" }

// baseTopLevel is the base image's top level (Debian's, without the
// lost+found of the image the microvm wall makes of it).
var baseTopLevel = []string{"bin", "boot", "dev", "etc", "home", "lib", "lib64", "media", "mnt", "opt", "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var"}
