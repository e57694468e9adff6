package interp

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// check runs cells in one language's default context and compares each
// one's main result (or stdout, where want starts with "stdout:", or the
// error's name, where it starts with "error:").
func check(t *testing.T, url, lang string, cells [][2]string) {
	t.Helper()
	for _, c := range cells {
		r := execute(t, context.Background(), url, inLang(lang, c[0]), nil)
		var got string
		switch {
		case strings.HasPrefix(c[1], "stdout:"):
			got = "stdout:" + r.text("stdout")
		case strings.HasPrefix(c[1], "error:"):
			if e := r.err(); e != nil {
				got = "error:" + e.str("name") + ": " + e.str("value")
			}
		default:
			got = r.mainText()
			if e := r.err(); e != nil {
				got = "error " + e.str("name") + ": " + e.str("value")
			}
		}
		if !strings.HasPrefix(got, c[1]) {
			t.Errorf("%s %q: got %q, want %q", lang, c[0], got, c[1])
		}
	}
}

// TestJavaScript: state between runs (let and const too, and cells run
// again), top-level await with its value, console.log to stdout, the last
// expression as the result, errors with their name, env_vars for one run.
func TestJavaScript(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "javascript")
	requireLanguage(t, s, "typescript")
	check(t, url, "javascript", [][2]string{
		{"let a = 1; const b = 2; a + b", "3"},
		{"a * 10 + b", "12"},
		{"let a = 5; a", "5"}, // the same cell again
		{"const c = await Promise.resolve(7); c * 2", "14"},
		{"c", "7"},
		{"function f() { return 'f' }\nawait null\nf()", "f"},
		{"f() + c", "f7"},
		{"class K { v() { return 3 } }\nnew K().v()", "3"},
		{"const { d, e: [g] } = { d: 4, e: [5] }; await 0; d + g", "9"},
		{"d * g", "20"},
		{"console.log('hello', { x: 1 }); 'last'", "last"},
		{"console.log('line1'); console.error('oops'); undefined", ""},
		{"for await (const v of [1, 2]) console.log(v)", "stdout:1\n2\n"},
		{"throw new TypeError('boom')", "error:TypeError: boom"},
		{"nope", "error:ReferenceError: nope is not defined"},
		{"import path from 'path'; path.join('a', 'b')", "a/b"},
		{"const os = require('os'); typeof os.cpus", "function"},
		{"[1, 2, 3].map(x => x * 2)", "[ 2, 4, 6 ]"},
	})
	value := "a'b\"c\nd`${x}`"
	want, _ := json.Marshal(value)
	r := execute(t, context.Background(), url, map[string]any{"code": "process.env.ONE_RUN === " + string(want), "language": "js",
		"env_vars": map[string]string{"ONE_RUN": value}}, nil)
	if got := r.mainText(); got != "true" {
		t.Errorf("env var in the run: %+v", r.lines)
	}
	check(t, url, "js", [][2]string{{"String(process.env.ONE_RUN)", "undefined"}})
}

// TestTypeScript: types are erased, state and await work as in JavaScript,
// and a type error in the code is no error at run time (tsc is not run).
func TestTypeScript(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "typescript")
	check(t, url, "typescript", [][2]string{
		{"interface P { a: number }\nconst p: P = { a: 2 }\np.a + 1", "3"},
		{"const q: number = await Promise.resolve(p.a * 10); q", "20"},
		{"function add(x: number, y: number): number { return x + y }\nadd(q, p.a)", "22"},
		{"enum Color { Red, Green }\nColor.Green", "1"},
		{"let s: string = 'x'; s.length", "1"},
		{"console.log(`${q}`)", "stdout:20\n"},
	})
}

// TestBash: variables, functions and the directory stay; stdout and stderr
// are apart; a failing command is an error with its status; stdin is empty.
func TestBash(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "bash")
	check(t, url, "bash", [][2]string{
		{"x=5; greet() { echo \"hi $1\"; }; cd /", "stdout:"},
		{"greet $x; pwd", "stdout:hi 5\n/\n"},
		{"echo out; echo err >&2; printf 'no newline'", "stdout:out\nno newline"},
		{"false", "error:CommandExitError: exit status 1"},
		{"read line; echo \"[$line]\"", "stdout:[]\n"},
		{"printf '\\x1e fake mark \\x1e'", "stdout:\x1e fake mark \x1e"},
		{"printf '\\xe2\\x82'; printf '\\xac\\n'", "stdout:€\n"},
	})
	r := execute(t, context.Background(), url, map[string]any{"code": "echo \"$V\"", "language": "bash",
		"env_vars": map[string]string{"V": "it's $HOME `x` \"q\"\nline2"}}, nil)
	if got := r.text("stdout"); got != "it's $HOME `x` \"q\"\nline2\n" {
		t.Errorf("env var: %q", got)
	}
	check(t, url, "bash", [][2]string{{"echo \"${V-unset}\"", "stdout:unset\n"}})
}

// TestResultMapping: MIME types map to E2B's fields, one pair of quotes
// is stripped from text, base64 loses its line breaks, the rest is extra.
func TestResultMapping(t *testing.T) {
	data := map[string]json.RawMessage{
		"text/plain": json.RawMessage(`"'quoted'"`), "text/html": json.RawMessage(`"<b>"`),
		"image/png": json.RawMessage(`"iVBO\nRw0K"`), "application/json": json.RawMessage(`{"a":1}`),
		"e2b/data": json.RawMessage(`{"x":[1,2]}`), "application/vnd.custom": json.RawMessage(`"c"`),
	}
	b, _ := json.Marshal(resultLine(data, true))
	want := `{"type":"result","is_main_result":true,"text":"quoted","html":"\u003cb\u003e","png":"iVBORw0K","json":{"a":1},"data":{"x":[1,2]},"extra":{"application/vnd.custom":"c"}}`
	if string(b) != want {
		t.Errorf("result line:\n%s\nwant\n%s", b, want)
	}
	for in, out := range map[string]string{`"'a'"`: `"a"`, `"\"b\""`: `"b"`, `"'c"`: `"'c"`, `"'"`: `"'"`, `"x'y'"`: `"x'y'"`} {
		if got := string(stripQuotes(json.RawMessage(in))); got != out {
			t.Errorf("stripQuotes(%s) = %s, want %s", in, got, out)
		}
	}
}

// TestEnvCode: the code that sets env_vars holds the values only as data
// (base64 for Python, a raw string whose delimiter the JSON cannot close
// for R, single quotes for bash), whatever they hold.
func TestEnvCode(t *testing.T) {
	hostile := map[string]string{"A": "'); import os; os.system('x'); ('", "B": `x]-`, "C": `y]--`}
	set, _ := pythonEnv(hostile)
	if strings.Contains(set, "os.system") || strings.Contains(set, "'x'") {
		t.Errorf("python: a value is code:\n%s", set)
	}
	set, _ = rEnv(hostile)
	if !strings.Contains(set, `r"---[`) || strings.Count(set, `]---"`) != 1 {
		t.Errorf("r: the raw string's delimiter is not longer than any in the values:\n%s", set)
	}
	set, _ = bashEnv(map[string]string{"A": "'; rm -rf /; echo '"})
	if !strings.Contains(set, `export A=''\''; rm -rf /; echo '\'''`) {
		t.Errorf("bash: %s", set)
	}
}

// recorder is an Output that keeps the text it is handed.
type recorder struct{ strings.Builder }

func (r *recorder) Count(int)                               {}
func (r *recorder) Stream(_, text string, _ time.Time)      { r.WriteString(text) }
func (r *recorder) Result(map[string]json.RawMessage, bool) {}
func (r *recorder) Error(string, string, string)            {}

// TestTakeMarks: marks split across reads come out as marks; a fake one
// (another nonce) and the text around them come out as text.
func TestTakeMarks(t *testing.T) {
	rec := &recorder{}
	p := &childProc{mark: []byte("\x1eabcd:"), marks: make(chan mark, 4), done: make(chan struct{}), out: rec}
	var held []byte
	for _, s := range []string{"one\x1eab", "cd:7\x1etwo \x1eother:1\x1e", "\x1eabcd:8", "\x1e three"} {
		var text []byte
		text, held = p.takeMarks("stdout", append(held, s...))
		p.emit("stdout", text)
	}
	if len(held) != 0 || rec.String() != "onetwo \x1eother:1\x1e three" {
		t.Errorf("text %q, held %q", rec.String(), held)
	}
	var seqs []int
	for len(p.marks) > 0 {
		seqs = append(seqs, (<-p.marks).seq)
	}
	if len(seqs) != 2 || seqs[0] != 7 || seqs[1] != 8 {
		t.Errorf("marks: %v, want [7 8]", seqs)
	}
}
