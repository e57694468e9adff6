package bench

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/seccomp"
)

// Dify's code nodes, measured: a python3 `main` returning a dict, wrapped
// in Dify's runner (inputs as base64 JSON, the result between <<RESULT>>
// markers), posted to /v1/sandbox/run as Dify posts it, against cage serve
// --dify and against dify-sandbox's design built here as the peer: a
// server with the same route that runs each request's code in a new
// python3 process under a seccomp filter and an unprivileged uid, without
// namespaces or cgroup limits (SeccompPeer).

// DifyKey is the key the benchmark's daemon and peer take.
const DifyKey = "cage-bench-dify"

// difyCode is the benchmark's node: Dify's python3 runner around a main
// that returns a dict.
func difyCode(i int) string {
	in, _ := json.Marshal(map[string]any{"name": "cage", "n": i})
	return `def main(name: str, n: int) -> dict:
    return {"greeting": "hello " + name, "square": n * n}

import json
from base64 import b64decode
inputs_obj = json.loads(b64decode('` + base64.StdEncoding.EncodeToString(in) + `').decode('utf-8'))
output_obj = main(**inputs_obj)
output_json = json.dumps(output_obj, indent=4)
print(f'''<<RESULT>>{output_json}<<RESULT>>''')
`
}

var difyResult = regexp.MustCompile(`(?s)<<RESULT>>(.*)<<RESULT>>`)

// DifyRun posts node i to url's /v1/sandbox/run as Dify does and checks
// the answer as Dify reads it, down to the dict.
func DifyRun(ctx context.Context, hc *http.Client, url string, i int) error {
	body, _ := json.Marshal(map[string]any{"language": "python3", "code": difyCode(i), "preload": "", "enable_network": true})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/sandbox/run", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Api-Key", DifyKey)
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	var env struct {
		Code    int
		Message string
		Data    struct{ Stdout, Error string }
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &env) != nil || env.Code != 0 || env.Data.Error != "" {
		return fmt.Errorf("run %d: %d %s", i, resp.StatusCode, bytesLine(b))
	}
	m := difyResult.FindStringSubmatch(env.Data.Stdout)
	var out struct{ Square int }
	if m == nil || json.Unmarshal([]byte(m[1]), &out) != nil || out.Square != i*i {
		return fmt.Errorf("run %d: result %q", i, env.Data.Stdout)
	}
	return nil
}

// DifyLatency times runs one after the other, alternating between the
// targets (drift hits them alike), after 3 warm-ups each.
func DifyLatency(ctx context.Context, urls []string, runs int) ([]stats.Stats, error) {
	hc := &http.Client{Timeout: time.Minute}
	samples := make([][]time.Duration, len(urls))
	for i := -3; i < runs; i++ {
		for k, u := range urls {
			start := time.Now()
			if err := DifyRun(ctx, hc, u, i+3); err != nil {
				return nil, fmt.Errorf("%s: %w", u, err)
			}
			if i >= 0 {
				samples[k] = append(samples[k], time.Since(start))
			}
		}
	}
	out := make([]stats.Stats, len(urls))
	for k := range samples {
		out[k] = stats.Summarize(samples[k])
	}
	return out, nil
}

// Throughput is n runs sent at once.
type Throughput struct {
	Latency stats.Stats // of the runs that succeeded
	Took    time.Duration
	Failed  int
	First   error // the first failure
}

// PerSecond is the runs answered per second.
func (t Throughput) PerSecond() float64 {
	return float64(t.Latency.N) / t.Took.Seconds()
}

// DifyThroughput sends n runs at once and waits for every answer.
func DifyThroughput(ctx context.Context, url string, n int) Throughput {
	hc := &http.Client{Timeout: 5 * time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	var mu sync.Mutex
	var t Throughput
	var samples []time.Duration
	var wg sync.WaitGroup
	began := time.Now()
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			err := DifyRun(ctx, hc, url, i)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Failed++
				if t.First == nil {
					t.First = err
				}
				return
			}
			samples = append(samples, time.Since(start))
		}()
	}
	wg.Wait()
	t.Took, t.Latency = time.Since(began), stats.Summarize(samples)
	return t
}

// SeccompPeer is dify-sandbox's design: a Go HTTP server whose run route
// starts python3 per request with a seccomp filter (cage's own: Docker's
// default allowlist) and an unprivileged uid, in the host's namespaces,
// without cgroup limits; at most workers at once and requests in flight
// (503 beyond), as dify-sandbox's max_workers and max_requests. It runs
// the host's python3 (Debian's /usr/bin/python3 where there is one).
type SeccompPeer struct {
	URL string

	exe      string // cage, for `cage bench seccomp-exec`
	python   string
	dir      string // the runs' working directory (dify-sandbox's sandbox dir)
	timeout  time.Duration
	workers  chan struct{}
	inflight chan struct{}
	srv      *http.Server
}

// StartSeccompPeer starts the peer on a loopback port.
func StartSeccompPeer(exe string, workers, requests int, timeout time.Duration) (*SeccompPeer, error) {
	python := "/usr/bin/python3" // the distribution's, not a shim under root's home that uid 65537 cannot run
	if _, err := os.Stat(python); err != nil {
		if python, err = exec.LookPath("python3"); err != nil {
			return nil, fmt.Errorf("the seccomp peer runs the host's python3: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "cage-bench-seccomp-")
	if err != nil {
		return nil, err
	}
	_ = os.Chmod(dir, 0o755)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	p := &SeccompPeer{URL: "http://" + l.Addr().String(), exe: exe, python: python, dir: dir, timeout: timeout,
		workers: make(chan struct{}, workers), inflight: make(chan struct{}, requests)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandbox/run", p.run)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = p.srv.Serve(l) }()
	return p, nil
}

// Stop stops the peer.
func (p *SeccompPeer) Stop() {
	_ = p.srv.Close()
	os.RemoveAll(p.dir)
}

func (p *SeccompPeer) run(w http.ResponseWriter, r *http.Request) {
	answer := func(status int, v any) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(v)
	}
	if r.Header.Get("X-Api-Key") != DifyKey {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	select {
	case p.inflight <- struct{}{}:
		defer func() { <-p.inflight }()
	default:
		answer(http.StatusServiceUnavailable, map[string]any{"code": -503, "message": "Too many requests", "data": nil})
		return
	}
	var req struct{ Language, Code string }
	if err := json.NewDecoder(io.LimitReader(r.Body, 16<<20)).Decode(&req); err != nil || req.Language != "python3" {
		answer(http.StatusBadRequest, map[string]any{"code": -400, "message": "bad request", "data": nil})
		return
	}
	p.workers <- struct{}{}
	defer func() { <-p.workers }()
	ctx, cancel := context.WithTimeout(r.Context(), p.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, p.exe, "bench", "seccomp-exec", "--", p.python, "-")
	cmd.Dir, cmd.Env = p.dir, []string{"PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"}
	cmd.Stdin = bytes.NewReader([]byte(req.Code))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code, msg := 0, ""
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		code, msg = -1, "process exited with code -1\nerror: timeout\n"
	case errors.As(err, &ee):
		code, msg = ee.ExitCode(), fmt.Sprintf("process exited with code %d\n%s", ee.ExitCode(), stderr.String())
	case err != nil:
		answer(http.StatusOK, map[string]any{"code": -500, "message": err.Error(), "data": nil})
		return
	}
	answer(http.StatusOK, map[string]any{"code": 0, "message": "success", "data": map[string]any{
		"stdout": stdout.String(), "stderr": stderr.String(), "error": msg, "exit_code": code}})
}

// PeerUID is the uid and gid the seccomp peer's runs take, dify-sandbox's
// sandbox user.
const PeerUID = 65537

// SeccompExec is `cage bench seccomp-exec -- ARGV`, the seccomp peer's
// runner: it drops to PeerUID with no groups, sets no_new_privs, installs
// cage's seccomp filter on every thread and execs argv, in the caller's
// namespaces. It returns only on failure.
func SeccompExec(argv []string) error {
	if len(argv) == 0 || !filepath.IsAbs(argv[0]) {
		return errors.New("seccomp-exec: want an absolute path to run")
	}
	runtime.LockOSThread()
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("seccomp-exec: setgroups: %w", err)
	}
	if err := syscall.Setresgid(PeerUID, PeerUID, PeerUID); err != nil {
		return fmt.Errorf("seccomp-exec: setresgid: %w", err)
	}
	if err := syscall.Setresuid(PeerUID, PeerUID, PeerUID); err != nil {
		return fmt.Errorf("seccomp-exec: setresuid: %w", err)
	}
	if err := seccomp.Install(); err != nil {
		return err
	}
	return unix.Exec(argv[0], argv, os.Environ())
}
