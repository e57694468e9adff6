package mcp

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/cagehq/cage/internal/client"
)

// connectServer runs a server whose daemon is an HTTP server counting the
// requests that reach it, and returns a client session of it.
func connectServer(t *testing.T) (*sdk.ClientSession, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	daemon := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Error(w, `{"code":404,"message":"not found: sandbox"}`, http.StatusNotFound)
	}))
	t.Cleanup(daemon.Close)
	s := NewServer(Config{Client: client.New(daemon.URL, daemon.URL, "e2b_test")})
	st, ct := sdk.NewInMemoryTransports()
	ctx := context.Background()
	ss, err := s.Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs, &hits
}

func resultText(r *sdk.CallToolResult) string {
	var b strings.Builder
	for _, c := range r.Content {
		if tc, ok := c.(*sdk.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

// TestInputValidation: bad arguments are tool errors (isError, never a
// protocol error) that name the problem, and none reaches the daemon.
func TestInputValidation(t *testing.T) {
	cs, hits := connectServer(t)
	long := strings.Repeat("a", maxCommandLen+1)
	cases := []struct {
		tool string
		args map[string]any
		want string
	}{
		{"exec", map[string]any{"command": "true"}, "sandbox_id"},
		{"exec", map[string]any{"sandbox_id": "abc"}, "command"},
		{"exec", map[string]any{"sandbox_id": "ABC", "command": "true"}, "sandbox_id"},
		{"exec", map[string]any{"sandbox_id": "../etc", "command": "true"}, "sandbox_id"},
		{"exec", map[string]any{"sandbox_id": strings.Repeat("a", 65), "command": "true"}, "sandbox_id"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": ""}, "command"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": long}, "command"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": "true", "timeout_s": 0}, "timeout_s"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": "true", "timeout_s": 3601}, "timeout_s"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": "true", "max_output_bytes": 10}, "max_output_bytes"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": "true", "envs": map[string]any{"1BAD": "x"}}, "envs"},
		{"exec", map[string]any{"sandbox_id": "abc", "command": "true", "surprise": true}, "surprise"},
		{"exec", map[string]any{"sandbox_id": 7, "command": "true"}, "sandbox_id"},
		{"run_code", map[string]any{"sandbox_id": "abc", "code": "1", "language": "cobol"}, "language"},
		{"run_code", map[string]any{"sandbox_id": "abc", "code": "1", "language": "python", "context_id": "c1"}, "not both"},
		{"file_read", map[string]any{"sandbox_id": "abc", "path": ""}, "path"},
		{"file_read", map[string]any{"sandbox_id": "abc", "path": "a\x00b"}, "NUL"},
		{"file_read", map[string]any{"sandbox_id": "abc", "path": "a", "max_bytes": maxReadBytes + 1}, "max_bytes"},
		{"file_read", map[string]any{"sandbox_id": "abc", "path": "a", "encoding": "latin1"}, "encoding"},
		{"file_write", map[string]any{"sandbox_id": "abc", "path": "a", "content": "%%", "encoding": "base64"}, "base64"},
		{"file_write", map[string]any{"sandbox_id": "abc", "path": "a", "content": "x", "mode": "rwx"}, "mode"},
		{"file_list", map[string]any{"sandbox_id": "abc", "depth": 6}, "depth"},
		{"file_list", map[string]any{"sandbox_id": "abc", "max_entries": 0}, "max_entries"},
		{"port_url", map[string]any{"sandbox_id": "abc", "port": 0}, "port"},
		{"port_url", map[string]any{"sandbox_id": "abc", "port": 65536}, "port"},
		{"sandbox_create", map[string]any{"timeout_s": -1}, "timeout_s"},
		{"sandbox_create", map[string]any{"wall": "chroot"}, "wall"},
		{"sandbox_list", map[string]any{"state": "dead"}, "state"},
		{"sandbox_kill", map[string]any{}, "sandbox_id"},
	}
	for _, c := range cases {
		r, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: c.tool, Arguments: c.args})
		if err != nil {
			t.Errorf("%s %v: a protocol error (%v), want a tool error", c.tool, c.args, err)
			continue
		}
		if !r.IsError || !strings.Contains(resultText(r), c.want) {
			t.Errorf("%s %v: isError=%v %q, want a tool error naming %q", c.tool, c.args, r.IsError, clip(resultText(r), 300), c.want)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Errorf("the daemon got %d requests from invalid calls, want none", n)
	}
	// A valid call does reach the daemon, and its 404 is a tool error.
	r, err := cs.CallTool(context.Background(), &sdk.CallToolParams{Name: "exec", Arguments: map[string]any{"sandbox_id": "abc", "command": "true"}})
	if err != nil || !r.IsError || !strings.Contains(resultText(r), "not found") || hits.Load() == 0 {
		t.Errorf("a valid exec of an unknown sandbox: %v, %+v (daemon hits %d), want the daemon's not found as a tool error", err, r, hits.Load())
	}
}

// TestToolsDocumented: every tool has a description, annotations, an
// output schema, and every input property a description.
func TestToolsDocumented(t *testing.T) {
	cs, _ := connectServer(t)
	res, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Tools) != len(ToolNames) {
		t.Errorf("%d tools listed, want %d", len(res.Tools), len(ToolNames))
	}
	for _, tool := range res.Tools {
		if tool.Description == "" || tool.Annotations == nil || tool.OutputSchema == nil {
			t.Errorf("%s: description %q, annotations %v, output schema %v", tool.Name, tool.Description, tool.Annotations, tool.OutputSchema)
		}
		m := tool.InputSchema.(map[string]any)
		if m["additionalProperties"] != false {
			t.Errorf("%s: unknown arguments are not refused", tool.Name)
		}
		props, _ := m["properties"].(map[string]any)
		for name, p := range props {
			if d, _ := p.(map[string]any)["description"].(string); d == "" {
				t.Errorf("%s.%s has no description", tool.Name, name)
			}
		}
	}
}

// TestHTTPAuthBeforeBody: /mcp answers a missing, malformed or wrong key
// (and any credential in the URL) without reading a byte of the body; a
// credential in the URL is refused before the key is even looked at.
func TestHTTPAuthBeforeBody(t *testing.T) {
	var verified atomic.Int64
	type record struct {
		keyID  string
		status int
	}
	var recorded atomic.Pointer[record]
	h := Handler(HTTPConfig{
		Verify: func(key string) (string, error) {
			verified.Add(1)
			switch key {
			case "broken":
				return "", errors.New("store down")
			case "e2b_good":
				return "key_good", nil
			}
			return "", nil
		},
		Record: func(r *http.Request, keyID string, status int) {
			recorded.Store(&record{keyID, status})
		},
		Server: func(r *http.Request, key string) Config {
			return Config{Client: client.New("http://127.0.0.1:1", "http://127.0.0.1:1", key)}
		},
	})
	cases := []struct {
		name, target string
		header       map[string]string
		status       int
		verifies     bool
	}{
		{"no key", "/mcp", nil, 401, false},
		{"wrong bearer", "/mcp", map[string]string{"Authorization": "Bearer e2b_bad"}, 401, true},
		{"wrong X-API-Key", "/mcp", map[string]string{"X-API-Key": "e2b_bad"}, 401, true},
		{"basic auth", "/mcp", map[string]string{"Authorization": "Basic e2b_good"}, 401, false},
		{"empty bearer", "/mcp", map[string]string{"Authorization": "Bearer "}, 401, false},
		{"two keys", "/mcp", map[string]string{"Authorization": "Bearer e2b_good", "X-API-Key": "e2b_bad"}, 401, false},
		{"key in the URL", "/mcp?api_key=e2b_good", nil, 400, false},
		{"key in the URL beside a good one", "/mcp?token=e2b_good", map[string]string{"X-API-Key": "e2b_good"}, 400, false},
		{"a key's value under any name", "/mcp?q=e2b_good", map[string]string{"X-API-Key": "e2b_good"}, 400, false},
		{"store failure", "/mcp", map[string]string{"X-API-Key": "broken"}, 500, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := verified.Load()
			body := &trapBody{}
			req := httptest.NewRequest(http.MethodPost, c.target, body)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			for k, v := range c.header {
				req.Header.Set(k, v)
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			if w.Code != c.status {
				t.Errorf("status %d, want %d: %s", w.Code, c.status, w.Body)
			}
			if body.reads.Load() != 0 {
				t.Errorf("the body was read %d times before the key was accepted", body.reads.Load())
			}
			if got := verified.Load() != before; got != c.verifies {
				t.Errorf("the key was looked up: %v, want %v", got, c.verifies)
			}
			if strings.Contains(w.Body.String(), "e2b_good") {
				t.Errorf("the answer echoes the key: %s", w.Body)
			}
			if rec := recorded.Swap(nil); rec == nil || rec.keyID != "" || rec.status != c.status {
				t.Errorf("recorded %+v, want the refusal (%d) with no key", rec, c.status)
			}
		})
	}
	// The right key goes on to the MCP handler, which reads the body.
	body := &trapBody{data: `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`}
	req := httptest.NewRequest(http.MethodPost, "/mcp", body)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "bearer e2b_good")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != 200 || body.reads.Load() == 0 || !strings.Contains(w.Body.String(), `"serverInfo"`) {
		t.Errorf("with the right key: %d, %d reads, %s; want 200 and the initialize answer", w.Code, body.reads.Load(), w.Body)
	}
	if rec := recorded.Load(); rec == nil || rec.keyID != "key_good" || rec.status != 200 {
		t.Errorf("recorded %+v, want the key's id and 200", rec)
	}
}

// trapBody counts its reads.
type trapBody struct {
	data  string
	off   int
	reads atomic.Int64
}

func (b *trapBody) Read(p []byte) (int, error) {
	b.reads.Add(1)
	if b.off >= len(b.data) {
		return 0, io.EOF
	}
	n := copy(p, b.data[b.off:])
	b.off += n
	return n, nil
}

// TestCapture: within the limit everything, beyond it the head and the
// tail with a note of what was left out; UTF-8 is never cut mid-rune.
func TestCapture(t *testing.T) {
	c := newCapture(10)
	c.Write([]byte("0123456789"))
	if s, cut := c.text("stdout"); s != "0123456789" || cut {
		t.Errorf("at the limit: %q %v", s, cut)
	}
	c = newCapture(10)
	for i := 0; i < 1000; i++ {
		c.Write([]byte("abcdefghij"))
	}
	c.Write([]byte("END"))
	s, cut := c.text("stdout")
	if !cut || !strings.HasPrefix(s, "abcde\n") || !strings.HasSuffix(s, "\nhijEND"[2:]) || !strings.Contains(s, "9993 bytes of stdout left out") {
		t.Errorf("past the limit: %q %v", s, cut)
	}
	if c.total != 10003 {
		t.Errorf("total %d, want 10003", c.total)
	}
	c = newCapture(1024)
	big := strings.Repeat("é", 5000) // 2 bytes each
	for i := 0; i < len(big); i += 333 {
		c.Write([]byte(big[i:min(i+333, len(big))]))
	}
	s, _ = c.text("stderr")
	if !utf8.ValidString(s) || strings.ContainsRune(s, utf8.RuneError) {
		t.Errorf("a cut inside a rune shows: %q", clip(s, 100))
	}
}

// TestEncodeRead: auto gives text for UTF-8, an image for a PNG read
// whole, base64 for other bytes; utf8 refuses binary; a cut rune at the
// end of a partial read is left for the next read.
func TestEncodeRead(t *testing.T) {
	png, _ := base64.StdEncoding.DecodeString("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
	r, out, err := encodeRead("auto", png, readOut{Path: "p.png", Size: int64(len(png))})
	if err != nil || out.Encoding != "image" || len(r.Content) != 2 {
		t.Fatalf("a PNG: %v %+v", err, out)
	}
	if img, ok := r.Content[1].(*sdk.ImageContent); !ok || img.MIMEType != "image/png" || string(img.Data) != string(png) {
		t.Errorf("a PNG is not image content: %#v", r.Content[1])
	}
	if _, _, err := encodeRead("auto", png[:20], readOut{Path: "p.png", Size: int64(len(png)), Truncated: true}); err == nil || !strings.Contains(err.Error(), "max_bytes") {
		t.Errorf("part of a PNG: %v, want an error saying to read it whole", err)
	}
	_, out, _ = encodeRead("auto", []byte{0xff, 0xfe, 0, 1}, readOut{Size: 4})
	if out.Encoding != "base64" || out.Content != "//4AAQ==" {
		t.Errorf("binary: %+v", out)
	}
	if _, _, err := encodeRead("utf8", []byte{0xff, 0xfe}, readOut{Size: 2}); err == nil || !strings.Contains(err.Error(), "base64") {
		t.Errorf("utf8 of binary: %v, want an error pointing at base64", err)
	}
	_, out, _ = encodeRead("auto", []byte("ab\xc3"), readOut{Size: 10, Truncated: true})
	if out.Encoding != "utf8" || out.Content != "ab" || out.Bytes != 2 {
		t.Errorf("a rune cut by max_bytes: %+v", out)
	}
}

// Attack: a key holder sends one small request on /mcp carrying a JSON-RPC
// batch of many calls (each file_read up to 8 MiB, answered in one JSON
// body built whole in memory: 48 reads made 100 MB of answer, 389 MiB of
// heap), or many requests at once. Expected: a batch is refused (400,
// whatever white space comes first) and a single message still served; a
// key's 17th request in flight gets 429 while another key's is served.
func TestHTTPBatchesAndFloodsBounded(t *testing.T) {
	release := make(chan struct{})
	var waiting atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		waiting.Add(1)
		<-release
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("[]"))
	}))
	defer api.Close()
	h := Handler(HTTPConfig{
		Verify: func(key string) (string, error) { return "id_" + key, nil },
		Server: func(r *http.Request, key string) Config { return Config{Client: client.New(api.URL, api.URL, key)} },
	})
	post := func(key, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer "+key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	initialize := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`
	if w := post("e2b_a", " \n\t["+initialize+","+initialize+"]"); w.Code != 400 || !strings.Contains(w.Body.String(), "batches are not served") {
		t.Errorf("a batch: %d %s; want 400", w.Code, w.Body)
	}
	if w := post("e2b_a", " \n"+initialize); w.Code != 200 || !strings.Contains(w.Body.String(), `"serverInfo"`) {
		t.Errorf("one message after white space: %d %s; want 200", w.Code, w.Body)
	}
	list := `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"sandbox_list","arguments":{}}}`
	done := make(chan int, maxInFlightPerKey)
	for range maxInFlightPerKey {
		go func() { done <- post("e2b_a", list).Code }()
	}
	for waiting.Load() < maxInFlightPerKey {
		time.Sleep(10 * time.Millisecond)
	}
	past := make(chan *httptest.ResponseRecorder, 1)
	go func() { past <- post("e2b_a", list) }()
	select {
	case w := <-past:
		if w.Code != http.StatusTooManyRequests {
			t.Errorf("the key's request past %d in flight: %d %s; want 429", maxInFlightPerKey, w.Code, w.Body)
		}
	case <-time.After(30 * time.Second):
		t.Errorf("the key's request past %d in flight was taken in (it waits with the others); want 429", maxInFlightPerKey)
	}
	other := make(chan int, 1)
	go func() { other <- post("e2b_b", list).Code }()
	for waiting.Load() < maxInFlightPerKey+1 {
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	for range maxInFlightPerKey {
		if code := <-done; code != 200 {
			t.Errorf("a request in flight: %d; want 200", code)
		}
	}
	if code := <-other; code != 200 {
		t.Errorf("another key's request while the first was at its bound: %d; want 200", code)
	}
	if w := post("e2b_a", list); w.Code != 200 {
		t.Errorf("the key's request once the others ended: %d %s; want 200", w.Code, w.Body)
	}
}

// TestHTTPArgumentsNotDecodedIntoTrees: a tool call whose 8 MiB body is
// an argument of 2.7 million empty objects is refused (400, one line)
// before the SDK decodes it: the SDK checks arguments against the tool's
// schema by decoding them into Go maps and slices, some 100 bytes of the
// daemon's heap for each 3 bytes sent (found by review, 2026-12-04: one
// such request allocated some 450 MB, and a key has 16 in flight). An
// honest call holds a few hundred values; a file_write of 4 MiB of text
// still passes.
func TestHTTPArgumentsNotDecodedIntoTrees(t *testing.T) {
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, `{"code":404,"message":"sandbox abc not found"}`, http.StatusNotFound)
	}))
	defer api.Close()
	h := Handler(HTTPConfig{
		Verify: func(key string) (string, error) { return "id_" + key, nil },
		Server: func(r *http.Request, key string) Config { return Config{Client: client.New(api.URL, api.URL, key)} },
	})
	post := func(body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/mcp", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer e2b_a")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	call := func(args string) string {
		return `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"exec","arguments":` + args + `}}`
	}
	tree := call(`{"sandbox_id":"abc","command":"true","surprise":[` + strings.Repeat("{},", (MaxHTTPBody-200)/3) + `{}]}`)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	w := post(tree)
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("a body of %d bytes: %d %.200s; %d bytes allocated", len(tree), w.Code, w.Body, alloc)
	if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "JSON values") {
		t.Errorf("a call of %d bytes of empty objects: %d %.200s; want 400 naming the JSON values", len(tree), w.Code, w.Body)
	}
	if alloc > 64<<20 {
		t.Errorf("a call of %d bytes of empty objects allocated %d MiB, want under 64 MiB", len(tree), alloc>>20)
	}
	write := call(`{"sandbox_id":"abc","path":"/tmp/x","content":"` + strings.Repeat("[{},]", 4<<20/5) + `"}`)
	write = strings.Replace(write, `"exec"`, `"file_write"`, 1)
	if w := post(write); w.Code != http.StatusOK || !strings.Contains(w.Body.String(), "not found") {
		t.Errorf("a file_write of 4 MiB: %d %.300s; want 200 and the API's not found", w.Code, w.Body)
	}
}
