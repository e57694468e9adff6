package mcp

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/client"
)

// repeated is a stream of the same NDJSON line, n times, then the end.
type repeated struct {
	line, end []byte
	left, off int
}

func (l *repeated) Read(p []byte) (int, error) {
	if l.left == 0 {
		if l.off >= len(l.end) {
			return 0, io.EOF
		}
		n := copy(p, l.end[l.off:])
		l.off += n
		return n, nil
	}
	n := copy(p, l.line[l.off:])
	l.off += n
	if l.off == len(l.line) {
		l.off = 0
		l.left--
	}
	return n, nil
}

// TestRunCodeResultsBounded: a server on the interpreter's port (code in
// the tenant's sandbox may replace it) answering with 300 result lines of
// 2 MiB each (text and JSON) leaves the daemon holding at most its bounds:
// 64 results, 1 MiB of their text and JSON, and says what it left out.
// (Before: every line's JSON and the whole line under each clipped text,
// 428 MiB of heap for 400 lines in a review's run, for up to an hour.)
func TestRunCodeResultsBounded(t *testing.T) {
	big := strings.Repeat("A", 1<<20)
	stream := &repeated{line: []byte(`{"type":"result","text":"` + big + `","json":"` + big + `","extra":{"x":1}}` + "\n"),
		left: 300, end: []byte(`{"type":"end_of_execution"}` + "\n")}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := &codeRun{stdout: newCapture(1 << 10), stderr: newCapture(1 << 10)}
	if err := r.read(stream); err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 8<<20 {
		t.Errorf("the daemon holds %d MiB more after 600 MiB of results", grown>>20)
	}
	if len(r.results) > maxResults || r.kept > maxResultBytes {
		t.Errorf("%d results, %d bytes kept", len(r.results), r.kept)
	}
	_, out, err := r.answer()
	if err != nil {
		t.Fatal(err)
	}
	if !out.Truncated || len(out.Results) == 0 {
		t.Errorf("answer: truncated %v, %d results", out.Truncated, len(out.Results))
	}
	res, _, _ := r.answer()
	if tc, ok := res.Content[0].(*sdk.TextContent); !ok || !strings.Contains(tc.Text, "cage: left out: results past the first") {
		t.Errorf("the answer does not say results were left out: %+v", res.Content[0])
	}
	runtime.KeepAlive(r)
}

// TestRunCodeLinesNotDecodedIntoTrees: a result line of 24 MiB whose json
// (or extra) is a list of millions of tiny values is read without
// building a tree of them. Before, each such line took 380 MiB of heap
// while it was read (1 GiB allocated), and four run_code calls at once
// took a daemon from 35 MiB to 2.4 GiB; what is kept is unchanged: the
// JSON's form is named, the JSON itself is over 64 KiB and left out.
func TestRunCodeLinesNotDecodedIntoTrees(t *testing.T) {
	n := (maxLineSize - 64) / 2
	list := "[" + strings.Repeat("0,", n-1) + "0]"
	keys := "{" + strings.Repeat(`"k":0,`, n/4) + `"last":[1]}`
	stream := io.MultiReader(
		strings.NewReader(`{"type":"result","json":`+list+"}\n"),
		strings.NewReader(`{"type":"result","text":"t","extra":`+keys+"}\n"),
		strings.NewReader(`{"type":"result","json":{"small": [1, 2]},"extra":{"text/x-a":1,"text/x-b":[2]}}`+"\n"),
		strings.NewReader(`{"type":"end_of_execution"}`+"\n"))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := &codeRun{stdout: newCapture(1 << 10), stderr: newCapture(1 << 10)}
	if err := r.read(stream); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 128<<20 {
		t.Errorf("reading 2 lines of 24 MiB allocated %d MiB", alloc>>20)
	}
	if len(r.results) != 3 {
		t.Fatalf("%d results, want 3", len(r.results))
	}
	if f := r.results[0].Formats; len(f) != 1 || f[0] != "json" || r.results[0].JSON != nil {
		t.Errorf("the big JSON: formats %v, kept %v", f, r.results[0].JSON != nil)
	}
	if f := r.results[1].Formats; !slices.Contains(f, "k") || !slices.Contains(f, "text") {
		t.Errorf("extra's forms: %v", f)
	}
	if j, _ := json.Marshal(r.results[2].JSON); string(j) != `{"small":[1,2]}` {
		t.Errorf("a small JSON kept as %s", j)
	}
	if f := r.results[2].Formats; strings.Join(f, ",") != "json,text/x-a,text/x-b" {
		t.Errorf("forms %v", f)
	}
	if !slices.Contains(r.dropped, "a result's JSON over 64 KiB") {
		t.Errorf("dropped: %v", r.dropped)
	}
}

// Attack: the server on a sandbox's port 49999 (its own code may serve
// it) answers run_code's POST /execute with a redirect to a service only
// the host reaches (cloud metadata, a loopback port). Expected: the
// redirect is not followed: the service sees nothing (neither the code
// nor the sandbox's tokens), and the tool's error says what the sandbox
// answered.
func TestRunCodeFollowsNoRedirect(t *testing.T) {
	var reached atomic.Int64
	hostOnly := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		http.Error(w, "host-only secret", http.StatusForbidden)
	}))
	defer hostOnly.Close()
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"sandboxID": "sbx1", "templateID": "base", "state": "running",
			"envdAccessToken": "envd-token", "trafficAccessToken": "traffic-token"})
	}))
	defer api.Close()
	for _, code := range []int{http.StatusTemporaryRedirect, http.StatusFound, http.StatusPermanentRedirect} {
		proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", hostOnly.URL+"/latest/meta-data/")
			w.WriteHeader(code)
		}))
		s := NewServer(Config{Client: client.New(api.URL, proxy.URL, "e2b_test")})
		st, ct := sdk.NewInMemoryTransports()
		ctx := context.Background()
		ss, err := s.Connect(ctx, st, nil)
		if err != nil {
			t.Fatal(err)
		}
		cs, err := sdk.NewClient(&sdk.Implementation{Name: "test", Version: "1"}, nil).Connect(ctx, ct, nil)
		if err != nil {
			t.Fatal(err)
		}
		res, err := cs.CallTool(ctx, &sdk.CallToolParams{Name: "run_code", Arguments: map[string]any{"sandbox_id": "sbx1", "code": "print(1)"}})
		if err != nil {
			t.Fatal(err)
		}
		if text := resultText(res); !res.IsError || !strings.Contains(text, fmt.Sprintf("HTTP %d", code)) || strings.Contains(text, "secret") {
			t.Errorf("a %d from the sandbox: %q (error %v); want an error naming it", code, text, res.IsError)
		}
		cs.Close()
		ss.Close()
		proxy.Close()
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("the host-only service was reached %d times through the sandbox's redirects", n)
	}
}

// Attack: the server on a sandbox's port 49999 answers run_code with an
// error line whose name, value and traceback are 7 MiB each, then keeps
// the run going (the daemon holds its answer until the run's timeout_s,
// up to an hour, 16 calls of a key at once). Expected: the run's error
// keeps at most 256 bytes of the name, 64 KiB of the value and 16 KiB of
// the traceback, and the daemon holds no more than that of the line.
// (Before: name and value were kept whole, and the clipped traceback kept
// its whole string: 24 MiB of heap a call, in the answer too.)
func TestRunCodeErrorBounded(t *testing.T) {
	big := strings.Repeat("E", 7<<20)
	line := `{"type":"error","name":"` + big + `","value":"` + big + `","traceback":"` + big + `"}` + "\n"
	stream := io.MultiReader(
		strings.NewReader(line),
		strings.NewReader(`{"type":"error","name":"second","value":"v"}`+"\n"),
		strings.NewReader(`{"type":"end_of_execution"}`+"\n"))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := &codeRun{stdout: newCapture(1 << 10), stderr: newCapture(1 << 10)}
	if err := r.read(stream); err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 2<<20 {
		t.Errorf("the daemon holds %d MiB more after an error line of 21 MiB", grown>>20)
	}
	res, out, err := r.answer()
	if err != nil {
		t.Fatal(err)
	}
	e := out.Error
	if e == nil || !strings.HasPrefix(e.Name, "EEE") {
		t.Fatalf("the run's error: %+v, want the first one's", e)
	}
	if len(e.Name) > 256+3 || len(e.Value) > 64<<10+3 || len(e.Traceback) > 16<<10+3 {
		t.Errorf("error kept: name %d, value %d, traceback %d bytes", len(e.Name), len(e.Value), len(e.Traceback))
	}
	if tc, ok := res.Content[0].(*sdk.TextContent); !ok || len(tc.Text) > 128<<10 {
		t.Errorf("the answer's text is not bounded: %d bytes", len(resultText(res)))
	}
	runtime.KeepAlive(r)
	runtime.KeepAlive(line) // the sandbox's bytes: not the daemon's to count
}

// stalled is a stream that sends its bytes and then nothing, without
// ending (a sandbox keeping the run going); reached is closed once all
// its bytes were read.
type stalled struct {
	r       io.Reader
	reached chan struct{}
	stop    chan struct{}
}

func (s *stalled) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err == io.EOF {
		close(s.reached)
		<-s.stop
		return 0, io.ErrUnexpectedEOF
	}
	return n, err
}

// Attack: the server on a sandbox's port 49999 answers run_code with one
// line of 20 MiB and then sends nothing more, keeping the run (and the
// call) going up to its timeout_s, an hour. Expected: once the line is
// read, the daemon holds no more than a line reader's buffer of it (the
// line's output kept: 1 KiB here). Before, the bufio.Scanner kept the
// buffer the line grew it to, 24 MiB, for the rest of the call (16 calls
// of a key at once).
func TestRunCodeLongLineNotHeld(t *testing.T) {
	line := `{"type":"stdout","text":"` + strings.Repeat("x", 20<<20) + `"}` + "\n"
	s := &stalled{r: strings.NewReader(line), reached: make(chan struct{}), stop: make(chan struct{})}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r := &codeRun{stdout: newCapture(1 << 10), stderr: newCapture(1 << 10)}
	done := make(chan error, 1)
	go func() { done <- r.read(s) }()
	select {
	case <-s.reached:
	case <-time.After(time.Minute):
		t.Fatal("the line was not read")
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 4<<20 {
		t.Errorf("the daemon holds %d MiB during a run after a line of 20 MiB", grown>>20)
	}
	close(s.stop)
	if err := <-done; err == nil {
		t.Error("a stream cut short read as a whole run")
	}
	if r.stdout.total != 20<<20 {
		t.Errorf("stdout: %d bytes, want %d", r.stdout.total, 20<<20)
	}
	runtime.KeepAlive(line)
}

// The line reader gives each line as the scanner did (no end of line, a
// last line without one, \r\n as \n) and refuses a line over its bound.
func TestLineReader(t *testing.T) {
	in := "a\r\n\n" + strings.Repeat("b", 100) + "\nlast"
	lr := &lineReader{br: bufio.NewReaderSize(strings.NewReader(in), 16), max: 200}
	var got []string
	for {
		l, err := lr.next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(l))
	}
	if want := []string{"a", "", strings.Repeat("b", 100), "last"}; !slices.Equal(got, want) {
		t.Errorf("lines %q, want %q", got, want)
	}
	lr = &lineReader{br: bufio.NewReaderSize(strings.NewReader(strings.Repeat("c", 300)+"\n"), 16), max: 200}
	if _, err := lr.next(); err != errLineTooLong {
		t.Errorf("a line of 300 bytes over 200: %v", err)
	}
}

// Attack: the sandbox's agent (inside the wall, assumed compromised) ends
// an exec's command with an end event whose reason and error are 2 MiB
// each (its messages may be 4 MiB). Expected: the answer keeps at most 64
// bytes of the reason and 4 KiB of the error, valid UTF-8.
func TestExecEndWordsBounded(t *testing.T) {
	huge := strings.Repeat("\xff", 2<<20)
	end := &pb.ProcessEvent_EndEvent{Reason: huge, Error: &huge, Exited: true, ExitCode: 1}
	out := execAnswer(end, newCapture(1<<10), newCapture(1<<10), 60, time.Second)
	if len(out.Reason) > 64+3*4 || len(out.Error) > 4<<10+3*4 {
		t.Errorf("the answer keeps %d bytes of the reason, %d of the error", len(out.Reason), len(out.Error))
	}
	if !utf8.ValidString(out.Reason) || !utf8.ValidString(out.Error) {
		t.Error("the agent's words are kept as invalid UTF-8")
	}
}
