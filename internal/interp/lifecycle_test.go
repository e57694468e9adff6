package interp

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestDisconnectInterrupts: a client that goes away mid-run (the SDK's
// timeoutMs) interrupts the run; the context keeps its state and runs the
// next code, in every language.
func TestDisconnectInterrupts(t *testing.T) {
	s, url := testServer(t, Config{})
	for _, c := range []struct{ lang, set, sleep, get, want string }{
		{"python", "kept = 41", "import time\nprint('started', flush=True)\ntime.sleep(600)", "kept + 1", "42"},
		{"javascript", "var kept = 41", "console.log('started'); while (true) {}", "kept + 1", "42"},
		{"javascript", "var kept2 = 41", "console.log('started'); await new Promise(() => {})", "kept2 + 1", "42"},
		{"bash", "kept=41", "echo started; sleep 600", "echo $((kept + 1))", "42\n"},
	} {
		t.Run(c.lang, func(t *testing.T) {
			requireLanguage(t, s, c.lang)
			execute(t, context.Background(), url, inLang(c.lang, c.set), nil)
			ctx, cancel := context.WithCancel(context.Background())
			execute(t, ctx, url, inLang(c.lang, c.sleep), func(l line) {
				if l.str("type") == "stdout" && strings.Contains(l.str("text"), "started") {
					cancel()
				}
			})
			r := execute(t, context.Background(), url, inLang(c.lang, c.get), nil)
			got := r.mainText()
			if c.lang == "bash" {
				got = r.text("stdout")
			}
			if got != c.want || r.err() != nil {
				t.Errorf("after the interrupted run: %+v", r.lines)
			}
		})
	}
}

// TestKernelDies: a run that kills its kernel ends with KernelDied; the
// next run in the context says so without running; a restart recovers.
func TestKernelDies(t *testing.T) {
	s, url := testServer(t, Config{})
	ctx := context.Background()
	for _, c := range []struct{ lang, kill, ok string }{
		{"python", "import os\nos.kill(os.getpid(), 9)", "1 + 1"},
		{"javascript", "process.exit(3)", "1 + 1"},
		{"bash", "exit 4", "echo 2"},
	} {
		t.Run(c.lang, func(t *testing.T) {
			requireLanguage(t, s, c.lang)
			var cj contextJSON
			if st, body := call(t, "POST", url+"/contexts", map[string]any{"language": c.lang}, &cj); st != 200 {
				t.Fatalf("create: %d %s", st, body)
			}
			for i := range 2 {
				r := execute(t, ctx, url, inContext(cj.ID, c.kill), nil)
				e := r.err()
				if e == nil || e.str("name") != "KernelDied" || !strings.Contains(e.str("value"), "restart the context") ||
					!strings.Contains(e.str("value"), cj.ID) {
					t.Errorf("run %d after the kernel died: %+v", i+1, r.lines)
				}
			}
			if st, body := call(t, "POST", url+"/contexts/"+cj.ID+"/restart", nil, nil); st != 200 {
				t.Fatalf("restart: %d %s", st, body)
			}
			r := execute(t, ctx, url, inContext(cj.ID, c.ok), nil)
			if r.err() != nil || (r.mainText() != "2" && r.text("stdout") != "2\n") {
				t.Errorf("after the restart: %+v", r.lines)
			}
		})
	}
}

// TestOutputBounded: a run that prints 50 MB sends at most the server's
// limit and a note that the rest was dropped; the context goes on.
func TestOutputBounded(t *testing.T) {
	s, url := testServer(t, Config{MaxOutput: 4 << 20})
	ctx := context.Background()
	for _, c := range []struct{ lang, flood, after string }{
		{"python", "import sys\nfor _ in range(50):\n    sys.stdout.write('x' * (1 << 20))\n'end'", "1 + 1"},
		{"javascript", "for (let i = 0; i < 50; i++) process.stdout.write('x'.repeat(1 << 20)); 'end'", "1 + 1"},
		{"bash", "head -c 52428800 /dev/zero | tr '\\0' x", "echo $((1 + 1))"},
	} {
		t.Run(c.lang, func(t *testing.T) {
			requireLanguage(t, s, c.lang)
			r := execute(t, ctx, url, inLang(c.lang, c.flood), nil)
			out := r.text("stdout")
			if len(out) > 4<<20 || len(out) < 1<<20 || strings.Trim(out, "x") != "" {
				t.Errorf("stdout of a 50 MB flood: %d bytes (want between 1 MiB and the 4 MiB limit, all of it the flood's)", len(out))
			}
			if !strings.Contains(r.text("stderr"), "passed the interpreter's limit of 4 MiB") {
				t.Errorf("no note of the dropped output in stderr: %q", r.text("stderr"))
			}
			if n := len(r.of("result")); n != 0 {
				t.Errorf("results after the limit: %d", n)
			}
			a := execute(t, ctx, url, inLang(c.lang, c.after), nil)
			if a.mainText() != "2" && a.text("stdout") != "2\n" {
				t.Errorf("the next run: %+v", a.lines)
			}
		})
	}
}

// TestKeepalive: a run silent for longer than KeepaliveEvery gets keepalive
// lines (a client gone away is noticed by a write), and they do not count
// as output.
func TestKeepalive(t *testing.T) {
	s, url := testServer(t, Config{})
	requireLanguage(t, s, "bash")
	defer func(d time.Duration) { KeepaliveEvery = d }(KeepaliveEvery)
	KeepaliveEvery = 100 * time.Millisecond
	r := execute(t, context.Background(), url, inLang("bash", "sleep 0.7; echo done"), nil)
	if n := len(r.of("keepalive")); n < 3 {
		t.Errorf("%d keepalive lines in a 0.7 s silence with keepalive every 0.1 s: %+v", n, r.lines)
	}
	if r.text("stdout") != "done\n" {
		t.Errorf("stdout: %q", r.text("stdout"))
	}
}
