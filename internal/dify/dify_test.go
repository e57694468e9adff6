package dify

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/network"
)

// The HTTP side of the service, with the sandbox run replaced by a
// function: routes, the key, binding as dify-sandbox binds, the envelope,
// overload. Runs in real sandboxes are test/dify's.

const testKey = "k3y-for-tests"

func newTestServer(t *testing.T, cfg Config, run func(context.Context, runRequest, string) (*Result, error)) *httptest.Server {
	t.Helper()
	cfg.Key = testKey
	s, err := New(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if run != nil {
		s.run = run
	}
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(ts.Close)
	return ts
}

func echoRun(_ context.Context, req runRequest, _ string) (*Result, error) {
	return &Result{Stdout: req.Language + ":" + req.Code + ":" + map[bool]string{true: "net", false: "nonet"}[req.EnableNetwork]}, nil
}

type answer struct {
	status int
	body   []byte
	env    envelope
}

func do(t *testing.T, ts *httptest.Server, method, path, key, ctype string, body io.Reader) answer {
	t.Helper()
	req, err := http.NewRequest(method, ts.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("X-Api-Key", key)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode}
	a.body, _ = io.ReadAll(resp.Body)
	if len(a.body) > 0 && a.body[0] == '{' {
		if err := json.Unmarshal(a.body, &a.env); err != nil {
			t.Fatalf("%s %s: not an envelope: %s", method, path, a.body)
		}
	}
	return a
}

func TestBindAsDifySandbox(t *testing.T) {
	ts := newTestServer(t, Config{MaxBody: 1 << 10}, echoRun)
	form := func() (io.Reader, string) {
		var b bytes.Buffer
		mw := multipart.NewWriter(&b)
		_ = mw.WriteField("language", "nodejs")
		_ = mw.WriteField("code", "1+1")
		fw, _ := mw.CreateFormFile("file", "x.bin")
		_, _ = fw.Write(bytes.Repeat([]byte("z"), 100))
		_ = mw.Close()
		return &b, mw.FormDataContentType()
	}
	mpBody, mpType := form()
	for _, c := range []struct {
		name, path, ctype string
		body              io.Reader
		status, code      int
		msg, stdout       string
	}{
		{"json", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"python3","code":"print(1)","preload":"","enable_network":true,"dependencies":[]}`), 200, 0, "success", "python3:print(1):net"},
		{"json with charset", "/v1/sandbox/run", "application/json; charset=utf-8", strings.NewReader(`{"language":"nodejs","code":"x"}`), 200, 0, "success", "nodejs:x:nonet"},
		{"malformed json", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":`), 400, -400, "invalid JSON body", ""},
		{"malformed json, charset", "/v1/sandbox/run", "application/json; charset=utf-8", strings.NewReader(`{`), 200, -400, "invalid JSON body", ""},
		{"malformed, text/plain", "/v1/sandbox/run", "text/plain", strings.NewReader(`{"language":"python3","code":"1"}`), 200, -400, "language is required", ""},
		{"no type, query", "/v1/sandbox/run?language=python3&code=q", "", strings.NewReader(`ignored`), 200, 0, "success", "python3:q:nonet"},
		{"array", "/v1/sandbox/run", "application/json", strings.NewReader(`[1]`), 400, -400, "invalid JSON body", ""},
		{"wrong type", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"python3","code":"1","enable_network":"yes"}`), 400, -400, "invalid JSON body", ""},
		{"empty json", "/v1/sandbox/run", "application/json", strings.NewReader(``), 400, -400, "empty body", ""},
		{"no code", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"python3"}`), 400, -400, "code is required", ""},
		{"null", "/v1/sandbox/run", "application/json", strings.NewReader(`null`), 400, -400, "language is required", ""},
		{"ruby", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"ruby","code":"1"}`), 400, -400, "unsupported language", ""},
		{"jinja2 is python3 to Dify", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"jinja2","code":"1"}`), 400, -400, "unsupported language", ""},
		{"form", "/v1/sandbox/run", "application/x-www-form-urlencoded", strings.NewReader(`language=python3&code=print%282%29&enable_network=1`), 200, 0, "success", "python3:print(2):net"},
		{"form, bad bool", "/v1/sandbox/run", "application/x-www-form-urlencoded", strings.NewReader(`language=python3&code=1&enable_network=maybe`), 200, -400, "enable_network", ""},
		{"multipart", "/v1/sandbox/run", mpType, mpBody, 200, 0, "success", "nodejs:1+1:nonet"},
		{"too large", "/v1/sandbox/run", "application/json", strings.NewReader(`{"language":"python3","code":"` + strings.Repeat("a", 2000) + `"}`), 413, -400, "larger than 1024 bytes", ""},
		{"dependencies, nodejs", "/v1/sandbox/dependencies?language=nodejs", "", nil, 400, -400, "unsupported language", ""},
		{"dependencies, none", "/v1/sandbox/dependencies", "", nil, 200, -400, "language is required", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			method := http.MethodPost
			if strings.Contains(c.path, "dependencies") {
				method = http.MethodGet
			}
			a := do(t, ts, method, c.path, testKey, c.ctype, c.body)
			if a.status != c.status || a.env.Code != c.code || !strings.Contains(a.env.Message, c.msg) {
				t.Fatalf("got %d %s; want %d with code %d and a message with %q", a.status, a.body, c.status, c.code, c.msg)
			}
			if c.code != 0 {
				if !bytes.Contains(a.body, []byte(`"data":null`)) {
					t.Fatalf("an error's data is null: %s", a.body)
				}
				return
			}
			var data Result
			b, _ := json.Marshal(a.env.Data)
			_ = json.Unmarshal(b, &data)
			if data.Stdout != c.stdout {
				t.Fatalf("stdout %q, want %q", data.Stdout, c.stdout)
			}
		})
	}
}

func TestRoutes(t *testing.T) {
	ts := newTestServer(t, Config{}, echoRun)
	if a := do(t, ts, http.MethodGet, "/health", "", "", nil); a.status != 200 || string(a.body) != `"ok"` {
		t.Fatalf("/health: %d %s", a.status, a.body)
	}
	a := do(t, ts, http.MethodGet, "/v1/sandbox/dependencies?language=python3", testKey, "", nil)
	deps, _ := json.Marshal(a.env.Data)
	if a.status != 200 || a.env.Code != 0 || a.env.Message != "success" ||
		string(deps) != `{"dependencies":[{"name":"jinja2","version":""},{"name":"httpx","version":""},{"name":"requests","version":""}]}` {
		t.Fatalf("dependencies: %d %s", a.status, a.body)
	}
	if b := do(t, ts, http.MethodGet, "/v1/sandbox/dependencies/refresh?language=python3", testKey, "", nil); !bytes.Equal(b.body, a.body) {
		t.Fatalf("refresh %s, want the list %s", b.body, a.body)
	}
	if a := do(t, ts, http.MethodPost, "/v1/sandbox/dependencies/update?language=python3", testKey, "", nil); a.status != 200 ||
		string(a.body) != `{"code":0,"message":"success","data":{}}` {
		t.Fatalf("update: %d %s", a.status, a.body)
	}
	// The dependency routes read a language's name, not a run's body: 8
	// KiB is refused before it is held (it was read up to max_body, 16
	// MiB, by any number of requests at once).
	pad := `{"language":"python3","pad":"` + strings.Repeat("x", 8<<10) + `"}`
	if a := do(t, ts, http.MethodPost, "/v1/sandbox/dependencies/update", testKey, "application/json", strings.NewReader(pad)); a.status != http.StatusRequestEntityTooLarge ||
		!strings.Contains(a.env.Message, "larger than 4096 bytes") {
		t.Fatalf("update with an 8 KiB body: %d %s; want 413", a.status, a.body)
	}
	if a := do(t, ts, http.MethodGet, "/v1/sandbox/run", testKey, "", nil); a.status != http.StatusMethodNotAllowed {
		t.Fatalf("GET run: %d %s", a.status, a.body)
	}
	if a := do(t, ts, http.MethodGet, "/v2/sandboxes", testKey, "", nil); a.status != 404 {
		t.Fatalf("an E2B route: %d", a.status)
	}
}

// TestKeyBeforeBody: a wrong or missing key is 401 with an empty body, for
// every route under /v1/sandbox/ (unknown ones too), before the body is
// read: a body that has not arrived (a declared length, or chunks that
// stop) does not hold the answer back, and no run starts.
func TestKeyBeforeBody(t *testing.T) {
	ran := false
	ts := newTestServer(t, Config{}, func(ctx context.Context, req runRequest, c string) (*Result, error) {
		ran = true
		return echoRun(ctx, req, c)
	})
	addr := strings.TrimPrefix(ts.URL, "http://")
	for _, key := range []string{"", "wrong", testKey + "x", testKey[:len(testKey)-1], strings.ToUpper(testKey)} {
		for _, path := range []string{"/v1/sandbox/run", "/v1/sandbox/dependencies?language=python3", "/v1/sandbox/nothing"} {
			for _, framing := range []string{"Content-Length: 1000000\r\n", "Transfer-Encoding: chunked\r\n"} {
				status, body := partialRequest(t, addr, path, key, framing)
				if status != "HTTP/1.1 401 Unauthorized" || body != "" {
					t.Fatalf("key %q at %s (%s): %q %q, want 401 with no body", key, path, strings.TrimSpace(framing), status, body)
				}
			}
		}
	}
	if ran {
		t.Fatal("a run ran without the key")
	}
}

// partialRequest sends a request's head and the start of its body, and
// reads the answer's status line and body (a 10 s deadline).
func partialRequest(t *testing.T, addr, path, key, framing string) (string, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	head := "POST " + path + " HTTP/1.1\r\nHost: dify\r\nContent-Type: application/json\r\n" + framing
	if key != "" {
		head += "X-Api-Key: " + key + "\r\n"
	}
	start := `{"language":"python3","code":"`
	if strings.HasPrefix(framing, "Transfer") {
		start = fmt.Sprintf("%x\r\n%s\r\n", len(start), start)
	}
	if _, err := c.Write([]byte(head + "\r\n" + start)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("%s with key %q (%s): no answer while the body is unfinished (was it read first?): %v", path, key, strings.TrimSpace(framing), err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.Proto + " " + resp.Status, string(b)
}

// TestOverload: MaxRequests in flight, the next gets 503 with
// dify-sandbox's envelope; MaxWorkers run at once, the rest wait their
// turn and are served.
func TestOverload(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	running, most := 0, 0
	s, err := New(Config{Key: testKey, MaxRequests: 3, MaxWorkers: 1}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.run = func(ctx context.Context, req runRequest, _ string) (*Result, error) {
		s.workers <- struct{}{} // the turn, as execute takes it
		defer func() { <-s.workers }()
		mu.Lock()
		running++
		most = max(most, running)
		mu.Unlock()
		<-release
		mu.Lock()
		running--
		mu.Unlock()
		return &Result{Stdout: req.Code}, nil
	}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	body := func() io.Reader { return strings.NewReader(`{"language":"python3","code":"c"}`) }
	results := make(chan answer, 3)
	for i := 0; i < 3; i++ {
		go func() { results <- do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, "application/json", body()) }()
	}
	for deadline := time.Now().Add(10 * time.Second); s.inflight.Load() < 3; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("three runs never were in flight")
		}
	}
	a := do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, "application/json", body())
	if a.status != http.StatusServiceUnavailable || string(a.body) != `{"code":-503,"message":"Too many requests","data":null}` {
		t.Fatalf("a fourth run: %d %s, want 503 and dify-sandbox's envelope", a.status, a.body)
	}
	close(release)
	for i := 0; i < 3; i++ {
		if a := <-results; a.status != 200 || a.env.Code != 0 {
			t.Fatalf("a run in flight: %d %s", a.status, a.body)
		}
	}
	if most != 1 {
		t.Fatalf("%d runs at once, want max_workers = 1", most)
	}
	if a := do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, "application/json", body()); a.status != 200 {
		t.Fatalf("after the load: %d %s", a.status, a.body)
	}
}

func TestConfig(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "a key is required"},
		{Config{Key: "k", Timeout: time.Millisecond}, "timeout"},
		{Config{Key: "k", MaxRequests: 2, MaxWorkers: 3}, "max_workers"},
		{Config{Key: "k", Memory: -1}, "negative"},
		{Config{Key: "k", Network: &network.Policy{Mode: "open"}}, "network"},
	} {
		if _, err := New(c.cfg, nil, nil); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error about %s", c.cfg, err, c.want)
		}
	}
	s, err := New(Config{Key: "k"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.Template != "base" || s.cfg.Timeout != 15*time.Second || s.cfg.Network.Mode != network.Internet {
		t.Fatalf("defaults: %+v", s.cfg)
	}
}

func TestErrorText(t *testing.T) {
	for _, c := range []struct {
		exit   int
		lines  []string
		stderr string
		want   string
	}{
		{0, nil, "a warning\n", ""},
		{0, []string{"error: output truncated at 8 MiB per stream"}, "", "error: output truncated at 8 MiB per stream\n"},
		{1, nil, "Traceback\n", "process exited with code 1\nTraceback\n"},
		{-1, []string{"error: timeout"}, "partial\n", "process exited with code -1\nerror: timeout\npartial\n"},
	} {
		if got := errorText(c.exit, c.lines, c.stderr); got != c.want {
			t.Errorf("errorText(%d, %q, %q) = %q, want %q", c.exit, c.lines, c.stderr, got, c.want)
		}
	}
	c := &capped{max: 4}
	n, err := c.Write([]byte("abcdef"))
	if n != 6 || err != nil || c.String() != "abcd" || c.dropped != 2 {
		t.Fatalf("capped: %d %v %q dropped %d", n, err, c.String(), c.dropped)
	}
}

// TestWaitingRunsHoldNoBody: of the runs in flight, only twice max_workers
// have their body read; the rest wait with it unread (it may be 16 MiB
// each: 200 waiting held 3.2 GiB), and all are served in turn.
func TestWaitingRunsHoldNoBody(t *testing.T) {
	release := make(chan struct{})
	var entered atomic.Int64
	s, err := New(Config{Key: testKey, MaxRequests: 10, MaxWorkers: 1}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.run = func(ctx context.Context, req runRequest, _ string) (*Result, error) {
		entered.Add(1) // the body has been read
		s.workers <- struct{}{}
		defer func() { <-s.workers }()
		<-release
		return &Result{Stdout: "ok"}, nil
	}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	code := strings.Repeat("x", 1<<20)
	results := make(chan answer, 10)
	for range 10 {
		go func() {
			results <- do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, "application/json",
				strings.NewReader(`{"language":"python3","code":"`+code+`"}`))
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); s.inflight.Load() < 10; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("ten runs never were in flight")
		}
	}
	time.Sleep(100 * time.Millisecond)
	if n := entered.Load(); n > 2 {
		t.Errorf("%d runs had their body read with one worker, want at most 2", n)
	}
	close(release)
	for range 10 {
		if a := <-results; a.status != 200 || a.env.Code != 0 {
			t.Fatalf("a run: %d %.200s", a.status, a.body)
		}
	}
}

// TestFitJSON: fitJSON's prefix and tailJSON's suffix take at most their
// budget in json.Marshal's output, cut between runes, and are as long as
// that allows, whatever bytes the code wrote (control bytes and '<' are 6
// bytes escaped, invalid UTF-8 6, a rune of four bytes 4).
func TestFitJSON(t *testing.T) {
	parts := []string{"a", "\x01", "<", "\n", "\"", "é", "✓", "𝄞", "\xff", "\xe2\x82", "\u2028", "&"}
	rng := rand.New(rand.NewPCG(1, 2))
	size := func(s string) int64 { b, _ := json.Marshal(s); return int64(len(b)) - 2 }
	for range 2000 {
		var b strings.Builder
		for range rng.IntN(40) {
			b.WriteString(parts[rng.IntN(len(parts))])
		}
		s, max := b.String(), int64(rng.IntN(80))
		head, cut := fitJSON(s, max)
		if !strings.HasPrefix(s, head) || size(head) > max || cut != (head != s) {
			t.Fatalf("fitJSON(%q, %d) = %q (%d bytes as JSON), %v", s, max, head, size(head), cut)
		}
		tail, cut := tailJSON(s, max)
		if !strings.HasSuffix(s, tail) || size(tail) > max || cut != (tail != s) {
			t.Fatalf("tailJSON(%q, %d) = %q (%d bytes as JSON), %v", s, max, tail, size(tail), cut)
		}
		if cut && len(tail) < len(s) {
			// one more rune would not fit
			_, n := utf8.DecodeLastRuneInString(s[:len(s)-len(tail)])
			if size(s[len(s)-len(tail)-n:]) <= max {
				t.Fatalf("tailJSON(%q, %d) = %q: one more rune fits", s, max, tail)
			}
		}
	}
}

// Attack: the sandbox's agent (inside the wall, assumed compromised) ends
// a run with an end event whose error (a start that failed) or status (a
// signal) is 4 MiB of control bytes, 24 MiB in the answer's JSON.
// Expected: the answer repeats at most 1 KiB of it, as JSON.
func TestDifyAgentWordsBounded(t *testing.T) {
	s := &Server{}
	huge := strings.Repeat("\x01", 4<<20)
	for _, end := range []*pb.ProcessEvent_EndEvent{{Reason: "start_failed", Error: &huge}, {Reason: "signal", Status: huge}} {
		lines := s.endLines(end, &Result{})
		b, _ := json.Marshal(errorText(1, lines, ""))
		if len(b) > 2<<10 {
			t.Errorf("%s: the answer's error is %d bytes as JSON, want at most 2 KiB", end.Reason, len(b))
		}
		if len(lines) != 1 || !strings.Contains(lines[0], "\x01") {
			t.Errorf("%s: lines %.80q, want one naming what the agent said", end.Reason, lines)
		}
	}
}

// TestMultipartPartsBounded: a multipart run's body has at most maxParts
// parts, as gin's binding (Go's ReadForm) allows dify-sandbox: one part
// more is refused (200 with -400, as a malformed form is), the code never
// run; maxParts are bound as before.
func TestMultipartPartsBounded(t *testing.T) {
	var runs atomic.Int64
	ts := newTestServer(t, Config{}, func(ctx context.Context, req runRequest, c string) (*Result, error) {
		runs.Add(1)
		return echoRun(ctx, req, c)
	})
	form := func(parts int) (io.Reader, string) {
		var b bytes.Buffer
		mw := multipart.NewWriter(&b)
		_ = mw.WriteField("language", "python3")
		_ = mw.WriteField("code", "1")
		for i := 2; i < parts; i++ {
			_ = mw.WriteField(fmt.Sprintf("f%d", i), "x")
		}
		_ = mw.Close()
		return &b, mw.FormDataContentType()
	}
	body, ctype := form(maxParts + 1)
	a := do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, ctype, body)
	if a.status != http.StatusOK || a.env.Code != -400 || !strings.Contains(a.env.Message, "more than 1000 parts") || runs.Load() != 0 {
		t.Fatalf("%d parts: got %d %s, %d runs; want 200, -400 \"more than 1000 parts\", no run", maxParts+1, a.status, a.body, runs.Load())
	}
	body, ctype = form(maxParts)
	if a := do(t, ts, http.MethodPost, "/v1/sandbox/run", testKey, ctype, body); a.env.Code != 0 || runs.Load() != 1 {
		t.Fatalf("%d parts: got %d %s; want success", maxParts, a.status, a.body)
	}
}
