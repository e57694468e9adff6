package interp

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// TestPythonRuns: a real ipykernel keeps state between runs; stdout and
// stderr arrive in order; an expression is the main result (E2B's quotes
// stripped); display() is a result that is not main; an exception is an
// error with name, value and a traceback.
func TestPythonRuns(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "python")
	ctx := context.Background()
	if r := execute(t, ctx, url, code("x = 20\nx + 1"), nil); r.mainText() != "21" {
		t.Fatalf("x + 1: %+v", r.lines)
	}
	r := execute(t, ctx, url, code("import sys\nprint('one', flush=True)\nprint('two', file=sys.stderr, flush=True)\nprint('three', flush=True)\n'x is %d' % x"), nil)
	if r.text("stdout") != "one\nthree\n" || r.text("stderr") != "two\n" || r.mainText() != "x is 20" {
		t.Errorf("streams and result: %+v", r.lines)
	}
	if n := r.of("number_of_executions"); len(n) != 1 || n[0]["execution_count"] != float64(2) {
		t.Errorf("number_of_executions: %v", n)
	}
	var order []string
	for _, l := range r.lines {
		order = append(order, l.str("type"))
	}
	if got := strings.Join(order, ","); got != "number_of_executions,stdout,stderr,stdout,result,end_of_execution" {
		t.Errorf("order of lines: %s", got)
	}
	r = execute(t, ctx, url, code("from IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))\nNone"), nil)
	if res := r.of("result"); len(res) != 1 || res[0]["is_main_result"] != false || res[0].str("html") != "<b>hi</b>" {
		t.Errorf("display(HTML): %+v", r.lines)
	}
	r = execute(t, ctx, url, code("def f():\n    return 1 / 0\nf()"), nil)
	e := r.err()
	if e == nil || e.str("name") != "ZeroDivisionError" || e.str("value") != "division by zero" ||
		!strings.Contains(e.str("traceback"), "----> 2     return 1 / 0") || strings.Contains(e.str("traceback"), "\x1b") {
		t.Errorf("exception: %+v", r.lines)
	}
	if r := execute(t, ctx, url, code("x"), nil); r.mainText() != "20" || r.err() != nil {
		t.Errorf("state after an exception: %+v", r.lines)
	}
	// NaN is no JSON: Python's messages may hold it all the same.
	if r := execute(t, ctx, url, code("from IPython.display import display, JSON\ndisplay(JSON({'a': float('nan')}))\nfloat('nan')"), nil); r.mainText() != "nan" {
		t.Errorf("NaN: %+v", r.lines)
	}
}

// TestEnvVarsOneRun: env_vars hold for the run that names them, whatever
// their value holds (quotes, a newline, a backslash, $), and the value
// from before is back for the next run.
func TestEnvVarsOneRun(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "python")
	ctx := context.Background()
	execute(t, ctx, url, code("import os\nos.environ['KEEP'] = 'before'"), nil)
	value := "it's \"quoted\"\nand $HOME \\ done"
	r := execute(t, ctx, url, map[string]any{"code": "print(os.environ['ONLY']); print(os.environ['KEEP'])",
		"env_vars": map[string]string{"ONLY": value, "KEEP": "during"}}, nil)
	if r.text("stdout") != value+"\nduring\n" {
		t.Errorf("during the run: %q", r.text("stdout"))
	}
	r = execute(t, ctx, url, code("print(os.environ.get('ONLY', 'unset')); print(os.environ['KEEP'])"), nil)
	if r.text("stdout") != "unset\nbefore\n" {
		t.Errorf("after the run: %q", r.text("stdout"))
	}
	if r := execute(t, ctx, url, code("[k for k in globals() if k.startswith('_cage')]"), nil); r.mainText() != "[]" {
		t.Errorf("names left in the user's namespace: %s", r.mainText())
	}
}

// TestBadInput: each malformed request gets its one-line refusal and
// status, and the server goes on serving.
func TestBadInput(t *testing.T) {
	_, url := testServer(t, Config{MaxRequest: 1 << 20})
	ctx := context.Background()
	cases := []struct {
		name string
		body any
		want int
		text string
	}{
		{"context and language", map[string]any{"code": "1", "context_id": "x", "language": "python"}, 400, "Only one of context_id or language can be provided"},
		{"unknown context", inContext("no-such", "1"), 404, "Context no-such not found"},
		{"unknown language", inLang("cobol", "1"), 400, `unknown language "cobol": this code interpreter runs bash, javascript, python, r, typescript`},
		{"no code", map[string]any{"language": "python"}, 422, "code is required"},
		{"code not a string", map[string]any{"code": 5}, 422, "cannot unmarshal number"},
		{"env name", map[string]any{"code": "1", "language": "bash", "env_vars": map[string]string{"A=B": "x"}}, 400, "is not an environment variable name"},
		{"env NUL", map[string]any{"code": "1", "language": "bash", "env_vars": map[string]string{"A": "x\x00y"}}, 400, "holds a NUL byte"},
		{"code of 10 MB", code(strings.Repeat("#", 10<<20)), 413, "request body is larger than 1048576 bytes"},
	}
	for _, c := range cases {
		r := execute(t, ctx, url, c.body, nil)
		if r.status != c.want || !strings.Contains(r.body, c.text) {
			t.Errorf("%s: %d %q, want %d with %q", c.name, r.status, r.body, c.want, c.text)
		}
	}
	for _, body := range []string{"{", "[]", "null", `{"code": "1"`} {
		resp, err := http.Post(url+"/execute", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnprocessableEntity {
			t.Errorf("body %q: %d, want 422", body, resp.StatusCode)
		}
	}
	if st, body := call(t, "GET", url+"/health", nil, nil); st != http.StatusServiceUnavailable {
		t.Errorf("health before Prestart: %d %s", st, body)
	}
}

// TestContexts: contexts are made in the directory asked for, listed,
// restarted (same id, state gone), removed (then unknown); a language's
// default context is made on first use; the number of contexts is bounded.
func TestContexts(t *testing.T) {
	s, url := testServer(t, Config{MaxContexts: 3})
	requireLanguage(t, s, "python")
	ctx := context.Background()
	dir := t.TempDir()
	var c contextJSON
	if st, body := call(t, "POST", url+"/contexts", map[string]any{"language": "Python", "cwd": dir}, &c); st != 200 {
		t.Fatalf("create: %d %s", st, body)
	}
	if c.Language != "python" || c.Cwd != dir || c.ID == "" {
		t.Errorf("created %+v", c)
	}
	if r := execute(t, ctx, url, inContext(c.ID, "import os\ny = 7\nos.getcwd()"), nil); r.mainText() != dir {
		t.Errorf("cwd: %+v", r.lines)
	}
	execute(t, ctx, url, code("1"), nil) // the default python context
	var list []contextJSON
	call(t, "GET", url+"/contexts", nil, &list)
	if len(list) != 2 {
		t.Errorf("list: %+v", list)
	}
	if st, body := call(t, "POST", url+"/contexts/"+c.ID+"/restart", nil, nil); st != 200 || strings.TrimSpace(body) != "null" {
		t.Fatalf("restart: %d %s", st, body)
	}
	r := execute(t, ctx, url, inContext(c.ID, "y"), nil)
	if e := r.err(); e == nil || e.str("name") != "NameError" {
		t.Errorf("state after restart: %+v", r.lines)
	}
	if r := execute(t, ctx, url, inContext(c.ID, "import os\nos.getcwd()"), nil); r.mainText() != dir {
		t.Errorf("cwd after restart: %+v", r.lines)
	}
	var c2 contextJSON
	call(t, "POST", url+"/contexts", map[string]any{"language": "bash"}, &c2)
	if st, body := call(t, "POST", url+"/contexts", map[string]any{"language": "bash"}, nil); st != http.StatusTooManyRequests ||
		!strings.Contains(body, "3 contexts exist") {
		t.Errorf("a fourth context: %d %s", st, body)
	}
	if st, _ := call(t, "DELETE", url+"/contexts/"+c.ID, nil, nil); st != 200 {
		t.Errorf("remove: %d", st)
	}
	if st, _ := call(t, "DELETE", url+"/contexts/"+c.ID, nil, nil); st != 404 {
		t.Errorf("remove again: %d", st)
	}
	if r := execute(t, ctx, url, inContext(c.ID, "1"), nil); r.status != 404 {
		t.Errorf("run in a removed context: %d", r.status)
	}
	for _, body := range []map[string]any{{"cwd": "relative"}, {"cwd": filepath.Join(dir, "missing")}, {"language": "cobol"}} {
		if st, msg := call(t, "POST", url+"/contexts", body, nil); st != 400 {
			t.Errorf("create %v: %d %s", body, st, msg)
		}
	}
}

// TestContextsParallel: runs in two contexts proceed at once (each waits
// for the other's file), runs in one context one after the other (the
// second, which would release the first, starts only after the first gave
// up waiting).
func TestContextsParallel(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "python")
	ctx := context.Background()
	dir := t.TempDir()
	wait := func(name string) string {
		return fmt.Sprintf("import os, time\nopen(%q, 'w').close()\nfor _ in range(3000):\n    if os.path.exists(%q): break\n    time.sleep(0.01)\nelse:\n    print('gave up')\nprint('done')",
			filepath.Join(dir, name+".mine"), filepath.Join(dir, otherOf(name)+".mine"))
	}
	var a, b contextJSON
	call(t, "POST", url+"/contexts", map[string]any{}, &a)
	call(t, "POST", url+"/contexts", map[string]any{}, &b)
	var wg sync.WaitGroup
	runs := make([]*run, 2)
	for i, id := range []string{a.ID, b.ID} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runs[i] = execute(t, ctx, url, inContext(id, wait([]string{"a", "b"}[i])), nil)
		}()
	}
	wg.Wait()
	for i, r := range runs {
		if r.text("stdout") != "done\n" {
			t.Errorf("context %d: %q (the other context's run did not go on at the same time)", i, r.text("stdout"))
		}
	}
	// One context: the second run waits for the first.
	first := fmt.Sprintf("import os, time\nfor _ in range(100):\n    if os.path.exists(%q): break\n    time.sleep(0.01)\nelse:\n    print('gave up')", filepath.Join(dir, "c"))
	started, firstDone := make(chan struct{}), make(chan *run, 1)
	go func() {
		firstDone <- execute(t, ctx, url, inContext(a.ID, first), func(l line) {
			if l.str("type") == "number_of_executions" {
				close(started)
			}
		})
	}()
	<-started
	second := execute(t, ctx, url, inContext(a.ID, fmt.Sprintf("open(%q, 'w').close()\n'second'", filepath.Join(dir, "c"))), nil)
	if second.mainText() != "second" {
		t.Fatalf("second run: %+v", second.lines)
	}
	if r := <-firstDone; r.text("stdout") != "gave up\n" {
		t.Errorf("first run in the context: %q (the second ran beside it)", r.text("stdout"))
	}
	if _, err := os.Stat(filepath.Join(dir, "c")); err != nil {
		t.Fatal(err)
	}
}

func otherOf(name string) string {
	if name == "a" {
		return "b"
	}
	return "a"
}
