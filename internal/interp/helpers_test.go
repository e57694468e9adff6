package interp

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// requireLanguage skips a test of a language this host cannot run, or
// fails it where CAGE_REQUIRE_KERNELS is set (scripts/test.sh installs
// python3-ipykernel, and TypeScript with test/e2b's packages).
func requireLanguage(t *testing.T, s *Server, lang string) {
	t.Helper()
	if _, err := s.language(lang); err != nil {
		if os.Getenv("CAGE_REQUIRE_KERNELS") != "" {
			t.Fatalf("CAGE_REQUIRE_KERNELS is set but %v", err)
		}
		t.Skipf("SKIP: %v", err)
	}
	if lang == "typescript" {
		if err := exec.Command("node", "-e", "require('typescript')").Run(); err != nil {
			if os.Getenv("CAGE_REQUIRE_KERNELS") != "" {
				t.Fatal("CAGE_REQUIRE_KERNELS is set but node cannot load typescript (npm ci in test/e2b)")
			}
			t.Skip("SKIP: node cannot load typescript (npm ci in test/e2b installs it)")
		}
	}
}

func init() {
	// TypeScript from test/e2b's packages where the host has no global one.
	_, file, _, _ := runtime.Caller(0)
	mods := filepath.Join(filepath.Dir(file), "../../test/e2b/node_modules")
	if _, err := os.Stat(filepath.Join(mods, "typescript")); err == nil && os.Getenv("NODE_PATH") == "" {
		os.Setenv("NODE_PATH", mods)
	}
}

// testServer is a Server behind an httptest server; its contexts start in
// a directory of the test's.
func testServer(t *testing.T, cfg Config) (*Server, string) {
	t.Helper()
	if cfg.Cwd == "" {
		cfg.Cwd = t.TempDir()
	}
	s := New(cfg)
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() { ts.Close(); s.Close() })
	return s, ts.URL
}

// line is one line of a run's stream.
type line map[string]any

func (l line) str(k string) string { v, _ := l[k].(string); return v }

// run is what one POST /execute streamed.
type run struct {
	status int
	body   string // a refusal's body
	lines  []line
}

func (r *run) of(typ string) []line {
	var out []line
	for _, l := range r.lines {
		if l.str("type") == typ {
			out = append(out, l)
		}
	}
	return out
}

// text is everything a stream (stdout or stderr) got.
func (r *run) text(stream string) string {
	var b strings.Builder
	for _, l := range r.of(stream) {
		b.WriteString(l.str("text"))
	}
	return b.String()
}

// mainText is the text of the run's main result ("" without one).
func (r *run) mainText() string {
	for _, l := range r.of("result") {
		if l["is_main_result"] == true {
			return l.str("text")
		}
	}
	return ""
}

func (r *run) err() line {
	if e := r.of("error"); len(e) > 0 {
		return e[0]
	}
	return nil
}

// execute posts body to /execute and reads the stream to its end; each
// line is also handed to onLine (may be nil) as it arrives.
func execute(t *testing.T, ctx context.Context, url string, body any, onLine func(line)) *run {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/execute", strings.NewReader(string(b)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST /execute: %v", err)
	}
	defer resp.Body.Close()
	r := &run{status: resp.StatusCode}
	if resp.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(resp.Body)
		r.body = string(data)
		return r
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("a line that is no JSON: %q", sc.Text())
		}
		r.lines = append(r.lines, l)
		if onLine != nil {
			onLine(l)
		}
	}
	if err := sc.Err(); err != nil && ctx.Err() == nil {
		t.Fatalf("reading the stream: %v", err)
	}
	if ctx.Err() == nil && (len(r.lines) == 0 || r.lines[len(r.lines)-1].str("type") != "end_of_execution") {
		t.Fatalf("the stream did not end with end_of_execution: %v", r.lines)
	}
	return r
}

func code(c string) map[string]any { return map[string]any{"code": c} }

func inLang(lang, c string) map[string]any { return map[string]any{"code": c, "language": lang} }

func inContext(id, c string) map[string]any { return map[string]any{"code": c, "context_id": id} }

// call makes a JSON request and decodes a 200's body into out.
func call(t *testing.T, method, url string, body any, out any) (int, string) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = strings.NewReader(string(b))
	}
	req, _ := http.NewRequest(method, url, rd)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK && out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: %v in %q", method, url, err, data)
		}
	}
	return resp.StatusCode, string(data)
}
