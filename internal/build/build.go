// Package build makes templates from Dockerfiles: the subset people use
// (FROM, RUN, COPY, ADD of local files, ENV, WORKDIR, USER, ARG, LABEL, CMD,
// ENTRYPOINT). RUN steps execute inside a cage sandbox of the image built so
// far (process wall, a writable overlay whose upper directory becomes the
// step's layer), never on the host; the network is theirs only when the
// build asks for it. Each step is cached by its instruction and inputs
// (the steps before it, the files it copies, the arguments and network it
// runs with), so an unchanged Dockerfile builds again without running
// anything. `FROM debian:bookworm` (and -slim) is made from Debian's mirror
// with mmdebstrap and kept as a template of its own.
package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/template"
)

// Builder builds templates into its Host's store.
type Builder struct {
	Host    *sandbox.Host     // runs the RUN steps; Host.Templates is the store
	Context string            // directory COPY and ADD read from
	Args    map[string]string // --build-arg values
	Net     network.Policy    // the RUN steps' network (mode none unless asked)
	NoCache bool
	Out     io.Writer // step lines and the RUN steps' output, live
	TTY     bool      // Out is a terminal: draw a progress bar
	Memory  int64     // each RUN sandbox's limits (defaults 2 GiB, 4 GiB)
	Disk    int64
	// StepTimeout bounds each RUN step, from its sandbox's create to its
	// command's end (0: DefaultStepTimeout). A step past it is killed with
	// its sandbox and fails the build (ErrStepTimeout).
	StepTimeout time.Duration
	// Mirror is the Debian mirror mmdebstrap uses for FROM debian:...
	Mirror string
	// NoDebootstrap makes FROM debian:... use the template only when it
	// has been made already: nothing is downloaded on the host (the
	// control API's builds).
	NoDebootstrap bool
}

// ErrFailed wraps a step that failed (a RUN that exited non-zero, a COPY of
// a missing file): the Dockerfile's fault, not cage's.
var ErrFailed = errors.New("build step failed")

// DefaultStepTimeout and MaxStepTimeout bound a RUN step's time: the
// default when a build names none, and the most it may name.
const (
	DefaultStepTimeout = time.Hour
	MaxStepTimeout     = 24 * time.Hour
)

// ErrStepTimeout is a RUN step that ran past its time limit (an
// ErrFailed: the Dockerfile's, or its limit's, fault).
var ErrStepTimeout = errors.New("ran past its time limit")

// CheckStepTimeout refuses a step time limit outside (0, MaxStepTimeout].
func CheckStepTimeout(d time.Duration) error {
	if d <= 0 || d > MaxStepTimeout {
		return fmt.Errorf("a RUN step's time limit must be more than 0 and at most %s, not %s", MaxStepTimeout, d)
	}
	return nil
}

// stepError is an ErrFailed with a message of its own.
type stepError struct {
	msg     string
	timeout bool
}

func (e *stepError) Error() string { return e.msg }
func (e *stepError) Is(target error) bool {
	return target == ErrFailed || target == ErrStepTimeout && e.timeout
}

func failf(format string, args ...any) error {
	return &stepError{msg: fmt.Sprintf(format, args...)}
}

// state is the image as built so far.
type state struct {
	layers []string
	cfg    imgstore.Config
	key    string // cache key of the steps so far
	vars   map[string]string
}

// maxState bounds what the steps add to the image's configuration and
// build arguments (a base image's are as large as its import allowed).
// Every step copies, hashes and expands from them: without it, ENV lines
// of 1 MiB each (maxExpanded) made the daemon hold, and hash at each
// step, gigabytes.
const maxState = 1 << 20

// size is the bytes of st's configuration and build arguments.
func (st *state) size() int {
	n := len(st.cfg.WorkingDir) + len(st.cfg.User)
	for _, l := range [][]string{st.cfg.Env, st.cfg.Entrypoint, st.cfg.Cmd} {
		for _, s := range l {
			n += len(s) + 1
		}
	}
	for k, v := range st.cfg.Labels {
		n += len(k) + len(v) + 2
	}
	for k, v := range st.vars {
		n += len(k) + len(v) + 2
	}
	return n
}

// Build builds the Dockerfile read from r as the template name.
func (b *Builder) Build(ctx context.Context, r io.Reader, name, source string) (*imgstore.Template, error) {
	store := b.Host.Templates
	if store == nil {
		return nil, errors.New("no template store")
	}
	steps, err := Parse(r)
	if err != nil {
		return nil, failf("%v", err)
	}
	var held imgstore.Held
	defer held.Release()
	st := &state{vars: map[string]string{}}
	fromSize := 0 // st.size() as FROM left it
	start := time.Now()
	for i, in := range steps {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		b.header(i, len(steps), in)
		t0 := time.Now()
		note, err := b.step(ctx, &held, st, in)
		if in.Cmd == "FROM" {
			fromSize = st.size()
		} else if err == nil && st.size() > fromSize+maxState {
			err = failf("the steps took the image's configuration and build arguments past %d KiB more than its base's", maxState>>10)
		}
		if err != nil {
			return nil, fmt.Errorf("step %d/%d (Dockerfile line %d) %s: %w", i+1, len(steps), in.Line, short(in), err)
		}
		if note != "" {
			fmt.Fprintf(b.Out, "  %s (%s)\n", note, time.Since(t0).Round(time.Millisecond))
		}
	}
	if len(st.layers) == 0 {
		return nil, failf("the image has no layers (FROM scratch and nothing added)")
	}
	t, err := store.Compose(name, st.layers, st.cfg, source, imgstore.Options{})
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(b.Out, "built template %s (%d layers) in %s\n", name, len(t.Layers), time.Since(start).Round(time.Millisecond))
	return t, nil
}

// header prints the step line: plain for logs, with a bar on a terminal.
func (b *Builder) header(i, n int, in Instruction) {
	if b.TTY {
		const width = 20
		done := width * i / n
		fmt.Fprintf(b.Out, "\x1b[1m[%s%s] %d/%d\x1b[0m %s\n", strings.Repeat("#", done), strings.Repeat(".", width-done), i+1, n, short(in))
		return
	}
	fmt.Fprintf(b.Out, "step %d/%d: %s\n", i+1, n, short(in))
}

func short(in Instruction) string {
	s := in.String()
	if len(s) > 120 {
		s = s[:117] + "..."
	}
	return s
}

// step runs one instruction; note says what it did when that is news.
func (b *Builder) step(ctx context.Context, held *imgstore.Held, st *state, in Instruction) (string, error) {
	args, err := expand(in.Args, b.scope(st))
	if err != nil {
		return "", failf("%v", err)
	}
	switch in.Cmd {
	case "ARG":
		k, v, hasDefault := strings.Cut(args, "=")
		if given, ok := b.Args[k]; ok {
			v = given
		} else if !hasDefault {
			v = ""
		}
		st.vars[k] = v
		st.key = chain(st.key, "ARG", k+"="+v)
		return "", nil
	case "FROM":
		return b.from(ctx, held, st, strings.TrimSpace(args))
	case "ENV":
		ps, err := pairs(args)
		if err != nil {
			return "", err
		}
		for _, p := range ps {
			st.cfg.Env = setEnv(st.cfg.Env, p[0], p[1])
		}
	case "LABEL":
		ps, err := pairs(args)
		if err != nil {
			return "", err
		}
		if st.cfg.Labels == nil {
			st.cfg.Labels = map[string]string{}
		}
		for _, p := range ps {
			st.cfg.Labels[p[0]] = p[1]
		}
	case "WORKDIR":
		wd := args
		if !path.IsAbs(wd) {
			wd = path.Join("/", st.cfg.WorkingDir, wd)
		}
		st.cfg.WorkingDir = path.Clean(wd)
	case "USER":
		st.cfg.User = args
	case "CMD", "ENTRYPOINT":
		argv := in.Exec
		if argv == nil {
			argv = []string{"/bin/sh", "-c", args}
		}
		if in.Cmd == "CMD" {
			st.cfg.Cmd = argv
		} else {
			st.cfg.Entrypoint = argv
		}
	case "COPY", "ADD":
		return b.copy(ctx, held, st, in, args)
	case "RUN":
		return b.run(ctx, held, st, in, args)
	}
	cfg, _ := json.Marshal(st.cfg)
	st.key = chain(st.key, "CONFIG", string(cfg))
	return "", nil
}

// scope is what $NAME expands to: the build arguments, then the image's
// environment.
func (b *Builder) scope(st *state) map[string]string {
	m := map[string]string{}
	for k, v := range st.vars {
		m[k] = v
	}
	for _, kv := range st.cfg.Env {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

func setEnv(env []string, k, v string) []string {
	for i, kv := range env {
		if strings.HasPrefix(kv, k+"=") {
			env[i] = k + "=" + v
			return env
		}
	}
	return append(env, k+"="+v)
}

// chain is the cache key of a step after the steps whose key is prev.
func chain(prev string, parts ...string) string {
	h := sha256.New()
	h.Write([]byte(prev))
	for _, p := range parts {
		h.Write([]byte{0})
		h.Write([]byte(p))
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (b *Builder) from(ctx context.Context, held *imgstore.Held, st *state, ref string) (string, error) {
	store := b.Host.Templates
	var base *imgstore.Template
	switch ref {
	case "scratch":
		st.key = chain("", "FROM scratch")
		return "", nil
	case "debian:bookworm", "debian:12", "debian:bookworm-slim", "debian:12-slim":
		var err error
		if base, err = b.debian(ctx, strings.HasSuffix(ref, "-slim")); err != nil {
			return "", err
		}
	default:
		var err error
		if base, err = store.Get(strings.TrimSuffix(ref, ":latest")); err != nil {
			return "", failf("FROM %s: %v (import or pull it first; registries are not reached from a build)", ref, err)
		}
	}
	if err := store.Hold(held, base.Layers); err != nil {
		return "", err
	}
	st.layers = append([]string(nil), base.Layers...)
	st.cfg = base.Config
	st.cfg.Env = append([]string(nil), base.Config.Env...)
	st.key = chain("", "FROM", base.ID)
	return fmt.Sprintf("from template %s", base.Name), nil
}

// cacheEntry is what a cached step made: a layer, or none.
type cacheEntry struct {
	Layer string `json:"layer,omitempty"`
}

func (b *Builder) cachePath(key string) string {
	return filepath.Join(b.Host.Templates.Dir(), "buildcache", key+".json")
}

// cached reports a usable cache entry for key, holding its layer.
func (b *Builder) cached(held *imgstore.Held, st *state, key string) bool {
	if b.NoCache {
		return false
	}
	data, err := os.ReadFile(b.cachePath(key))
	if err != nil {
		return false
	}
	var e cacheEntry
	if json.Unmarshal(data, &e) != nil {
		return false
	}
	if e.Layer != "" {
		if b.Host.Templates.Hold(held, []string{e.Layer}) != nil {
			return false // its layer was collected: build it again
		}
		st.layers = append(st.layers, e.Layer)
	}
	st.key = key
	return true
}

func (b *Builder) remember(key, layer string) {
	p := b.cachePath(key)
	_ = os.MkdirAll(filepath.Dir(p), 0o700)
	data, _ := json.Marshal(cacheEntry{Layer: layer})
	tmp := p + ".tmp"
	if os.WriteFile(tmp, data, 0o600) == nil {
		_ = os.Rename(tmp, p)
	}
}

// addLayer adds a layer tar to the store and to the image.
func (b *Builder) addLayer(ctx context.Context, held *imgstore.Held, st *state, tarPath, key string) (string, error) {
	d, err := b.Host.Templates.AddLayer(ctx, held, tarPath, "layer", imgstore.Options{})
	if err != nil {
		return "", err
	}
	st.layers = append(st.layers, d)
	st.key = key
	b.remember(key, d)
	return d, nil
}

// run runs a RUN step in a sandbox of the image so far and keeps what it
// changed as a layer.
func (b *Builder) run(ctx context.Context, held *imgstore.Held, st *state, in Instruction, args string) (string, error) {
	if len(st.layers) == 0 {
		return "", failf("RUN needs an image with a shell (FROM scratch has none)")
	}
	env, _ := json.Marshal(st.cfg)
	vars, _ := json.Marshal(st.vars)
	key := chain(st.key, "RUN", in.Args, strings.Join(in.Exec, "\x00"), string(env), string(vars), string(b.Net.Mode))
	if b.cached(held, st, key) {
		return "cached: not run", nil
	}
	argv := in.Exec
	if argv == nil {
		argv = []string{"/bin/sh", "-c", args}
	}
	wd := st.cfg.WorkingDir
	if wd == "" {
		wd = "/"
	}
	user := st.cfg.User
	if user == "" {
		user = "root"
	}
	if b.Net.Networked() {
		fmt.Fprintf(b.Out, "  with network: %s, as the build asked\n", b.Net.Mode)
	}
	name := "build-" + ids.NewToken()[:12]
	tmpl := &template.Template{Name: name, Build: true,
		Image: &template.Image{Store: b.Host.Templates, Info: imgstore.Ephemeral(name, st.layers, st.cfg)}}
	b.Host.SetTemplate(name, tmpl)
	defer b.Host.SetTemplate(name, nil)
	memory, disk := b.Memory, b.Disk
	if memory == 0 {
		memory = 2 << 30
	}
	if disk == 0 {
		disk = 4 << 30
	}
	envMap := map[string]string{}
	for k, v := range st.vars {
		envMap[k] = v
	}
	// The step's time runs from its sandbox's create to its command's
	// end; past it (or when ctx ends: a cancelled build) the sandbox is
	// destroyed at once, whatever its command or agent do, and the deferred
	// Destroy is the same one (Destroy happens once).
	limit := b.StepTimeout
	if limit == 0 {
		limit = DefaultStepTimeout
	}
	stepCtx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	timedOut := func(err error) error {
		if ctx.Err() == nil && errors.Is(stepCtx.Err(), context.DeadlineExceeded) {
			return &stepError{timeout: true, msg: fmt.Sprintf("the RUN step %s of %s (its sandbox was destroyed)", ErrStepTimeout, limit)}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return err
	}
	sb, err := b.Host.Create(stepCtx, sandbox.Options{Template: name, Memory: memory, Disk: disk, CPUs: float64(runtime.NumCPU()),
		Pids: 4096, Net: b.Net, Env: tmpl.EnvWith(envMap), BuildStep: true})
	if err != nil {
		return "", timedOut(err)
	}
	defer sb.Destroy()
	stopKill := context.AfterFunc(stepCtx, func() { _ = sb.Destroy() })
	defer stopKill()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	// WORKDIR is made as Docker makes it, in the step's layer.
	script := `mkdir -p -- "$0" && cd -- "$0" && exec "$@"`
	end, err := c.Run(stepCtx, agentclient.RunOptions{Cmd: "/bin/sh", Args: append([]string{"-c", script, wd}, argv...),
		User: user, Stdout: b.Out, Stderr: b.Out})
	if stepCtx.Err() != nil {
		return "", timedOut(err)
	}
	if err != nil {
		return "", err
	}
	if !stopKill() {
		return "", timedOut(nil) // the limit came as the command ended
	}
	if end.GetExitCode() != 0 || end.GetReason() != "exited" {
		return "", failf("exit code %d (%s)", end.GetExitCode(), end.GetReason())
	}
	tarFile, err := b.Host.Templates.Staging()
	if err != nil {
		return "", err
	}
	defer tarFile.Close()
	n, err := captureAfter(ctx, sb, filepath.Join(b.Host.RunDir, "sandboxes", sb.ID()), "disk/upper", disk, tarFile.Name())
	if err != nil {
		return "", err
	}
	if n == 0 {
		st.key = key
		b.remember(key, "")
		return "no changes", nil
	}
	d, err := b.addLayer(ctx, held, st, tarFile.Name(), key)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("layer %s, %d entries", d[7:19], n), nil
}
