package difytest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/testutil"
)

// TestDify is Dify's code nodes against one cage serve --dify (process
// wall, base template, pool of 4, runs of 8 s and 128 MiB, 64 KiB of
// output): results of the
// three runner templates, failures as Dify must see them, hostile code,
// bad requests, 100 runs at once, the audit trail, nothing left behind.
func TestDify(t *testing.T) {
	// A pool that keeps its size (--pool-grow 1), so that what is left at
	// the end can be told from what the pool holds. The timeout leaves
	// room for node's first start on a busy 2-CPU host (once over 4 s,
	// with a desktop test beside), and makes the timeout cases wait it.
	s := start(t, map[string]any{"timeout": "8s", "memory": "128M", "pids": 64, "pool": 4, "max_output": "64K"}, "--pool-grow", "1")
	t.Run("runners", s.testRunners)
	t.Run("failures", s.testFailures)
	t.Run("memory bomb", s.testMemoryBomb)
	t.Run("fork bomb", s.testForkBomb)
	t.Run("host files", s.testHostFiles)
	t.Run("network", s.testNetwork)
	t.Run("bad requests", s.testBadRequests)
	t.Run("100 at once", s.testConcurrent)
	t.Run("audit", s.testAudit)
	t.Run("nothing left", s.testNothingLeft)
	t.Run("no state left", func(t *testing.T) {
		// The pool's 4 and one in the making, no more: each run's
		// sandbox is gone from the host, not only from the store.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			ents, _ := os.ReadDir(filepath.Join(s.d.RunDir, "sandboxes"))
			if len(ents) <= 5 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d state directories under %s, want at most the pool's", len(ents), s.d.RunDir)
			}
		}
	})
}

func (s *service) testRunners(t *testing.T) {
	py := `def main(arg1: str, arg2: int) -> dict:
    return {"result": arg1 + " " + str(arg2 * 2), "chars": len(arg1)}
`
	out, err := s.mustRun(t, "python3", pythonRunner(py, map[string]any{"arg1": "héllo ✓", "arg2": 21}), "")
	if err != nil {
		t.Fatalf("python3: %v", err)
	}
	if r := result(t, out.Stdout); r["result"] != "héllo ✓ 42" || r["chars"] != float64(7) || out.ExitCode != 0 || out.Stderr != "" {
		t.Fatalf("python3: %v (%+v)", r, out)
	}
	js := `function main({arg1, arg2}) {
    return {result: arg1 + " " + (arg2 * 2), node: process.version.startsWith("v")}
}
`
	out, err = s.mustRun(t, "nodejs", nodeRunner(js, map[string]any{"arg1": "héllo ✓", "arg2": 21}), "")
	if err != nil {
		t.Fatalf("nodejs: %v", err)
	}
	if r := result(t, out.Stdout); r["result"] != "héllo ✓ 42" || r["node"] != true {
		t.Fatalf("nodejs: %v (%+v)", r, out)
	}
	tmpl := `{% for item in items %}- {{ item | upper }}
{% endfor %}{{ title }}`
	out, err = s.mustRun(t, "python3", jinjaRunner(tmpl, map[string]any{"items": []string{"a", "b"}, "title": "done"}), jinjaPreload)
	if err != nil {
		t.Fatalf("jinja2: %v", err)
	}
	m := resultRE.FindStringSubmatch(out.Stdout)
	if m == nil || m[1] != "- A\n- B\ndone" {
		t.Fatalf("jinja2 rendered %q", out.Stdout)
	}
	imports := `def main() -> dict:
    import httpx, requests, jinja2
    return {"ok": True}
`
	if out, err := s.mustRun(t, "python3", pythonRunner(imports, map[string]any{}), ""); err != nil || result(t, out.Stdout)["ok"] != true {
		t.Fatalf("import httpx, requests, jinja2: %v %+v", err, out)
	}
}

func (s *service) testFailures(t *testing.T) {
	for _, c := range []struct {
		name, language, code string
		exit                 int
		want                 []string // in the error Dify shows
	}{
		{"syntax error", "python3", pythonRunner("def main(:\n    return {}\n", nil), 1, []string{"process exited with code 1", "SyntaxError"}},
		{"exception", "python3", pythonRunner("def main() -> dict:\n    return {'x': 1 / 0}\n", map[string]any{}), 1, []string{"process exited with code 1", "ZeroDivisionError: division by zero"}},
		{"node exception", "nodejs", nodeRunner("function main() { throw new Error('no such thing') }", map[string]any{}), 1, []string{"process exited with code 1", "Error: no such thing"}},
		{"timeout", "python3", "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.1)\n", -1, []string{"process exited with code -1", "error: timeout"}},
		{"node timeout", "nodejs", "for (;;) {}", -1, []string{"error: timeout"}},
	} {
		out, err := s.mustRun(t, c.language, c.code, "")
		if err == nil || out.ExitCode != c.exit {
			t.Fatalf("%s: err %v, exit %d; want a failure with exit code %d (%+v)", c.name, err, out.ExitCode, c.exit, out)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Fatalf("%s: Dify's error %q lacks %q", c.name, err, w)
			}
		}
		if c.name == "timeout" && out.Stdout != "" && out.Stdout != "started\n" {
			t.Fatalf("timeout: stdout %q", out.Stdout)
		}
	}
	// Output past max_output is cut, and the run then fails, saying so:
	// a result cut short is no result.
	out, err := s.mustRun(t, "python3", "import sys\nsys.stdout.write('x' * 100000)\nprint('warn', file=sys.stderr)\n", "")
	if err == nil || out.ExitCode != 0 || len(out.Stdout) != 64<<10 || out.Stderr != "warn\n" ||
		out.Error != "error: output truncated at 64KiB per stream\n" {
		t.Fatalf("output past the bound: %v, exit %d, %d bytes of stdout, stderr %q, error %q", err, out.ExitCode, len(out.Stdout), out.Stderr, out.Error)
	}
	// Warnings on stderr with exit 0 are no failure: the result stands,
	// stderr is reported apart.
	warn := `import warnings, sys
def main() -> dict:
    warnings.warn("this API is deprecated", DeprecationWarning, stacklevel=1)
    warnings.warn("a user warning")
    print("log line", file=sys.stderr)
    return {"fine": True}
`
	out, err = s.mustRun(t, "python3", pythonRunner(warn, map[string]any{}), "")
	if err != nil || out.ExitCode != 0 || out.Error != "" || result(t, out.Stdout)["fine"] != true {
		t.Fatalf("warnings with exit 0: %v %+v", err, out)
	}
	if !strings.Contains(out.Stderr, "UserWarning: a user warning") || !strings.Contains(out.Stderr, "log line") {
		t.Fatalf("stderr %q lacks the warnings", out.Stderr)
	}
	out, err = s.mustRun(t, "nodejs", nodeRunner("function main() { console.error('careful'); console.warn('warned'); return {fine: true} }", map[string]any{}), "")
	if err != nil || out.Stderr != "careful\nwarned\n" || result(t, out.Stdout)["fine"] != true {
		t.Fatalf("node warnings with exit 0: %v %+v", err, out)
	}
}

func (s *service) testBadRequests(t *testing.T) {
	good, _ := json.Marshal(map[string]any{"language": "python3", "code": "print(1)", "enable_network": true})
	for _, c := range []struct {
		name, path, key, ctype string
		body                   []byte
		status                 int
		want                   string // the body, or a part of it
	}{
		{"no key", "/v1/sandbox/run", "", "application/json", good, 401, ""},
		{"wrong key", "/v1/sandbox/run", "dify-sandbox", "application/json", good, 401, ""},
		{"wrong key, dependencies", "/v1/sandbox/dependencies/update?language=python3", difyKey + "x", "", nil, 401, ""},
		{"malformed JSON", "/v1/sandbox/run", difyKey, "application/json", []byte(`{"language": "python3", "code": `), 400, `"code":-400`},
		{"malformed, text/plain", "/v1/sandbox/run", difyKey, "text/plain", []byte(`{"language": "python3", "code": `), 200, `"code":-400`},
		{"malformed, JSON with charset", "/v1/sandbox/run", difyKey, "application/json; charset=utf-8", []byte(`{`), 200, `"code":-400`},
		{"no code", "/v1/sandbox/run", difyKey, "application/json", []byte(`{"language":"python3"}`), 400, `"message":"code is required"`},
		{"unsupported language", "/v1/sandbox/run", difyKey, "application/json", []byte(`{"language":"ruby","code":"puts 1"}`), 400, `{"code":-400,"message":"unsupported language","data":null}`},
		{"dependencies update", "/v1/sandbox/dependencies/update?language=python3", difyKey, "", nil, 200, `{"code":0,"message":"success","data":{}}`},
	} {
		status, b, err := s.post(c.path, c.key, c.ctype, c.body)
		if err != nil {
			t.Fatal(err)
		}
		if status != c.status || (c.want == "" && len(b) != 0) || !bytes.Contains(b, []byte(c.want)) {
			t.Errorf("%s: %d %s; want %d with %q", c.name, status, b, c.status, c.want)
		}
	}
	resp, err := http.Get(s.url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || b.String() != `"ok"` {
		t.Fatalf("/health: %d %s", resp.StatusCode, b.String())
	}
	req, _ := http.NewRequest(http.MethodGet, s.url+"/v1/sandbox/dependencies?language=python3", nil)
	req.Header.Set("X-Api-Key", difyKey)
	resp, err = s.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var deps struct {
		Code int
		Data struct {
			Dependencies []struct{ Name, Version string }
		}
	}
	_ = json.NewDecoder(resp.Body).Decode(&deps)
	resp.Body.Close()
	if resp.StatusCode != 200 || deps.Code != 0 || len(deps.Data.Dependencies) != 3 || deps.Data.Dependencies[0].Name != "jinja2" {
		t.Fatalf("dependencies: %d %+v", resp.StatusCode, deps)
	}
}

// testConcurrent: 100 runs at once (dify #13147: random failures at 100
// with dify-sandbox), every one with its own right result.
func (s *service) testConcurrent(t *testing.T) {
	const n = 100
	code := `def main(i: int) -> dict:
    return {"i": i, "square": i * i}
`
	var wg sync.WaitGroup
	errs := make(chan error, n)
	began := time.Now()
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := s.run("python3", pythonRunner(code, map[string]any{"i": i}), "")
			if err != nil {
				errs <- fmt.Errorf("run %d: %v", i, err)
				return
			}
			m := resultRE.FindStringSubmatch(out.Stdout)
			var r map[string]float64
			if m == nil || json.Unmarshal([]byte(m[1]), &r) != nil || r["i"] != float64(i) || r["square"] != float64(i*i) {
				errs <- fmt.Errorf("run %d: %q", i, out.Stdout)
			}
		}()
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		failed++
		if failed <= 5 {
			t.Error(err)
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d runs failed", failed, n)
	}
	t.Logf("%d runs at once: all answered in %v", n, time.Since(began).Round(time.Millisecond))
}

// testAudit: a run is in the audit trail (process.code with its code's
// hash, language, exit code and outcome; the sandbox's create and kill),
// every call is an api.call (refused ones the operator's alone), and the
// chain verifies.
func (s *service) testAudit(t *testing.T) {
	marker := fmt.Sprintf("audit-%d", time.Now().UnixNano())
	code := "import sys\nprint('" + marker + "')\nsys.exit(3)\n"
	if out, _ := s.mustRun(t, "python3", code, ""); out.ExitCode != 3 {
		t.Fatalf("exit %d", out.ExitCode)
	}
	cage := filepath.Join(testutil.Binaries(t), "cage")
	var entry struct {
		SandboxID string `json:"sandboxID"`
		KeyID     string `json:"keyID"`
		Route     string `json:"route"`
		Detail    map[string]any
	}
	for deadline := time.Now().Add(20 * time.Second); entry.SandboxID == ""; time.Sleep(200 * time.Millisecond) {
		out, err := exec.Command(cage, "audit", "--data", s.d.Data, "--kind", "process.code", "--json").Output()
		if err != nil {
			t.Fatalf("cage audit: %v", err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, marker) {
				if err := json.Unmarshal([]byte(line), &entry); err != nil {
					t.Fatalf("%v: %s", err, line)
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the run is not in the audit trail")
		}
	}
	d := entry.Detail
	if entry.KeyID != "dify" || entry.Route != "POST /v1/sandbox/run" || d["via"] != "dify" || d["language"] != "python3" ||
		d["exit_code"] != float64(3) || d["outcome"] != "exit" || d["code_bytes"] != float64(len(code)) {
		t.Fatalf("the run's entry: %+v", entry)
	}
	var kinds []string
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		out, err := exec.Command(cage, "audit", "--data", s.d.Data, "--sandbox", entry.SandboxID, "--kind", "sandbox", "--json").Output()
		if err != nil {
			t.Fatalf("cage audit --sandbox: %v", err)
		}
		kinds = kinds[:0]
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			var e struct{ Kind string }
			_ = json.Unmarshal([]byte(line), &e)
			kinds = append(kinds, e.Kind)
		}
		if strings.Join(kinds, ",") == "sandbox.create,sandbox.kill" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the run's sandbox in the trail: %v, want its create and kill", kinds)
		}
	}
	// The refused call of testBadRequests is the operator's alone.
	out, err := exec.Command(cage, "audit", "--data", s.d.Data, "--kind", "api.call", "--json").Output()
	if err != nil {
		t.Fatalf("cage audit: %v", err)
	}
	var refused, runs int
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var e struct {
			KeyID, Route string
			Status       int
		}
		_ = json.Unmarshal([]byte(line), &e)
		switch {
		case e.Status == 401 && e.KeyID == "" && e.Route == "POST /v1/sandbox/run":
			refused++
		case e.Status == 200 && e.KeyID == "dify" && e.Route == "POST /v1/sandbox/run":
			runs++
		}
	}
	if refused < 2 || runs < 100 {
		t.Fatalf("api.call entries: %d refused runs, %d runs; want the 2 refused and the 100 at once at least", refused, runs)
	}
	if out, err := exec.Command(cage, "audit", "verify", "--data", s.d.Data).CombinedOutput(); err != nil {
		t.Fatalf("cage audit verify: %v: %s", err, out)
	}
}

// testNothingLeft: every run's sandbox is gone once its answer is out.
func (s *service) testNothingLeft(t *testing.T) {
	st, err := store.Open(s.d.Data)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left, _, err := st.ListSandboxes(store.ListFilter{KeyID: "dify"})
		if err != nil {
			t.Fatal(err)
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d runs' sandboxes are still there, e.g. %s (%s)", len(left), left[0].ID, left[0].State)
		}
	}
}
