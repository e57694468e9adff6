package audit

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	pb "github.com/cagehq/cage/api/gen/process"
)

// frame is one Connect stream message.
func frame(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 5+len(b))
	binary.BigEndian.PutUint32(out[1:5], uint32(len(b)))
	copy(out[5:], b)
	return out
}

// TestHostileAgentEvents: an agent (not trusted) answers one Start with
// 50,000 start events and 50,000 end events. The stream's call is one
// process.start and one process.end entry. (Before: every start event
// wrote again the detail map an earlier entry had handed to the writer's
// goroutine, a concurrent map write that ends the daemon, and every end
// event was an entry of its own in the queue every tenant shares.)
func TestHostileAgentEvents(t *testing.T) {
	tr := startTrail(t, Limits{})
	envs := map[string]string{}
	for i := range 300 { // a detail slow enough to marshal to overlap
		envs["NAME_"+itoa(int64(i))] = "v"
	}
	req := frame(t, &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/true", Envs: envs}})
	start := frame(t, &pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}})
	end := frame(t, &pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true}}}})
	var stream bytes.Buffer
	for range 50_000 {
		stream.Write(start)
		stream.Write(end)
	}
	r := httptest.NewRequest(http.MethodPost, "/process.Process/Start", bytes.NewReader(req))
	r.Header.Set("Content-Type", "application/connect+proto")
	observed, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
	_, _ = io.Copy(io.Discard, r.Body)
	resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/connect+proto"}},
		Body: io.NopCloser(&stream)}
	observed(resp)
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	done()
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil {
		t.Fatal(err)
	}
	if k := kinds(es); k[KindProcessStart] != 1 || k[KindProcessEnd] != 1 || len(es) != 2 {
		t.Errorf("entries of one hostile stream: %v, want one process.start and one process.end", k)
	}
}

// TestEntryStringsBounded: what a tenant chooses (a path, here 60 KiB)
// is kept to 4 KiB in an entry, so no tenant can make every entry large.
func TestEntryStringsBounded(t *testing.T) {
	tr := startTrail(t, Limits{})
	long := "/" + strings.Repeat("a", 60<<10)
	names := make([]string, 1000)
	for i := range names {
		names[i] = "N" + itoa(int64(i))
	}
	tr.Record(Event{Kind: KindFileRead, KeyID: "key1", SandboxID: "sb1",
		Detail: map[string]any{"path": long, "env_names": names, "nested": map[string]any{"cwd": long}}})
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil || len(es) != 1 {
		t.Fatalf("entries %v %v", es, err)
	}
	if len(es[0].Detail) > 12<<10 {
		t.Errorf("an entry with a 60 KiB path and 1,000 names is %d bytes", len(es[0].Detail))
	}
	var d struct {
		Path    string         `json:"path"`
		Names   []string       `json:"env_names"`
		NotKept int            `json:"env_names_not_kept"`
		Nested  map[string]any `json:"nested"`
	}
	if err := json.Unmarshal([]byte(es[0].Detail), &d); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(d.Path, long[:4096]) || !strings.HasSuffix(d.Path, "(truncated)") || len(d.Names) != maxListKept ||
		d.NotKept != 1000-maxListKept || len(d.Nested["cwd"].(string)) > 4200 {
		t.Errorf("path %d bytes, %d names (%d not kept), nested cwd %d bytes", len(d.Path), len(d.Names), d.NotKept,
			len(d.Nested["cwd"].(string)))
	}
}

// TestHostileAgentCompressedEvents: an agent (not trusted) answers one
// Start with 10 gzip-compressed messages of under 1 KiB that each
// inflate to 900 KiB, a compressed start and end event, then 3,000 more
// such bombs. The trail looks inside small compressed messages for the
// start and end events; it must not inflate a stream's bombs without
// bound: what it allocates for the whole stream stays under 64 MiB
// (before: every bomb was inflated, some 6 GB of the daemon's
// allocations and 5 s of its CPU for 2.8 MB relayed; an honest agent
// compresses no message under 4 KiB), and the start and the end are
// recorded as the agent sent them. An agent that spends the stream's
// budget before its events loses only its own word on them: the host
// still records the start it forwarded.
func TestHostileAgentCompressedEvents(t *testing.T) {
	var zb bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&zb, gzip.BestCompression)
	_, _ = zw.Write(make([]byte, 900<<10))
	_ = zw.Close()
	if zb.Len() > maxCompressedEvent {
		t.Fatalf("the bomb is %d bytes compressed, want at most %d", zb.Len(), maxCompressedEvent)
	}
	compressed := func(b []byte) []byte {
		out := make([]byte, 5+len(b))
		out[0] = 1 // compressed
		binary.BigEndian.PutUint32(out[1:5], uint32(len(b)))
		copy(out[5:], b)
		return out
	}
	gz := func(m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var z bytes.Buffer
		w := gzip.NewWriter(&z)
		_, _ = w.Write(b)
		_ = w.Close()
		return compressed(z.Bytes())
	}
	bomb := compressed(zb.Bytes())
	start := gz(&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 9}}}})
	end := gz(&pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true, ExitCode: 3}}}})

	for _, tc := range []struct {
		name          string
		before, after int
		agentStart    bool
		wantEnd       int
	}{
		{"events within the budget", 10, 3000, true, 1},
		{"events past the budget", 3000, 10, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := startTrail(t, Limits{})
			var stream bytes.Buffer
			for range tc.before {
				stream.Write(bomb)
			}
			stream.Write(start)
			stream.Write(end)
			for range tc.after {
				stream.Write(bomb)
			}
			req := frame(t, &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/true"}})
			r := httptest.NewRequest(http.MethodPost, "/process.Process/Start", bytes.NewReader(req))
			r.Header.Set("Content-Type", "application/connect+proto")
			observed, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
			_, _ = io.Copy(io.Discard, r.Body)
			resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/connect+proto"},
				"Connect-Content-Encoding": {"gzip"}}, Body: io.NopCloser(&stream)}
			relayed := stream.Len()
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			t0 := time.Now()
			observed(resp)
			if _, err := io.Copy(io.Discard, resp.Body); err != nil {
				t.Fatal(err)
			}
			took := time.Since(t0)
			runtime.ReadMemStats(&after)
			done()
			tr.Flush()
			alloc := after.TotalAlloc - before.TotalAlloc
			t.Logf("%d bytes relayed: %d bytes allocated, %v", relayed, alloc, took)
			if alloc > 64<<20 {
				t.Errorf("scanning a stream of %d bytes allocated %d MiB, want under 64 MiB", relayed, alloc>>20)
			}
			es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
			if err != nil {
				t.Fatal(err)
			}
			if k := kinds(es); k[KindProcessStart] != 1 || k[KindProcessEnd] != tc.wantEnd || len(es) != 1+tc.wantEnd {
				t.Fatalf("entries of the stream: %v, want one process.start and %d process.end", k, tc.wantEnd)
			}
			for _, e := range es {
				var d map[string]any
				if err := json.Unmarshal([]byte(e.Detail), &d); err != nil {
					t.Fatal(err)
				}
				switch e.Kind {
				case KindProcessStart:
					if _, agent := d["agent"]; agent != tc.agentStart || (d["started"] == false) == tc.agentStart {
						t.Errorf("start entry %s: want the agent's start %v", e.Detail, tc.agentStart)
					}
				case KindProcessEnd:
					if d["exit_code"] != float64(3) {
						t.Errorf("end entry %s: want exit code 3", e.Detail)
					}
				}
			}
		})
	}
}

// TestUploadPartHeadersBounded: a tenant's multipart upload whose part
// header runs to 8 MiB (1,000 lines of 8 KiB, the end of the header never
// sent) is parsed by the trail as it passes, and the trail's parser must
// not hold the header: the daemon's heap grows by under 2 MiB while the
// upload is held open (before: Go's multipart reader keeps up to 10 MiB
// of a part's header, so each such upload held 8 MiB of the daemon for as
// long as its client liked), and the upload is recorded undecoded.
func TestUploadPartHeadersBounded(t *testing.T) {
	tr := startTrail(t, Limits{})
	pr, pw := io.Pipe()
	r := httptest.NewRequest(http.MethodPost, "/files?username=user", pr)
	r.Header.Set("Content-Type", "multipart/form-data; boundary=BOUNDARY")
	_, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
	agentRead := make(chan error, 1)
	go func() { // the agent, reading the upload as it comes
		_, err := io.Copy(io.Discard, r.Body)
		agentRead <- err
	}()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	if _, err := io.WriteString(pw, "--BOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/x\"\r\n"); err != nil {
		t.Fatal(err)
	}
	line := "X-Pad: " + strings.Repeat("a", 8<<10) + "\r\n"
	for i := range 1000 {
		if _, err := io.WriteString(pw, "X-"+itoa(int64(i))+line[1:]); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("heap grown by %d bytes with 8 MiB of a part's header sent", grown)
	if grown > 2<<20 {
		t.Errorf("the daemon's heap grew by %d MiB with 8 MiB of an upload's part header held open, want under 2 MiB", grown>>20)
	}
	pw.CloseWithError(io.ErrUnexpectedEOF)
	<-agentRead
	done()
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 1 || es[0].Kind != KindFileWrite || !strings.Contains(es[0].Detail, "undecoded") {
		t.Errorf("entries %v, want one file.write, undecoded", es)
	}
}

// TestFilesystemRequestsInflatedToTheAgentsLimit: a tenant's compressed
// Remove request of about 1 KiB names a path of 1 MiB. The agent inflates
// a filesystem message to at most 64 KiB (then refuses it), and so does
// the trail: 100 such requests allocate under 32 MiB in the daemon
// (before: each was inflated to 1 MiB and decoded, some 300 MiB, a
// thousand times the bytes sent, more than the agent spent on them), and
// each is recorded undecoded.
func TestFilesystemRequestsInflatedToTheAgentsLimit(t *testing.T) {
	tr := startTrail(t, Limits{})
	b, err := proto.Marshal(&fspb.RemoveRequest{Path: "/" + strings.Repeat("a", 1<<20-64)})
	if err != nil {
		t.Fatal(err)
	}
	var z bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&z, gzip.BestCompression)
	_, _ = zw.Write(b)
	_ = zw.Close()
	t.Logf("a message of %d bytes, %d compressed", len(b), z.Len())
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 100 {
		r := httptest.NewRequest(http.MethodPost, "/filesystem.Filesystem/Remove", bytes.NewReader(z.Bytes()))
		r.Header.Set("Content-Type", "application/proto")
		r.Header.Set("Content-Encoding", "gzip")
		observed, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
		_, _ = io.Copy(io.Discard, r.Body)
		observed(&http.Response{StatusCode: http.StatusTooManyRequests, Header: http.Header{}, Body: http.NoBody})
		done()
	}
	runtime.ReadMemStats(&after)
	tr.Flush()
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("100 requests: %d bytes allocated", alloc)
	if alloc > 32<<20 {
		t.Errorf("100 compressed requests of %d bytes allocated %d MiB, want under 32 MiB", z.Len(), alloc>>20)
	}
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 100 || !strings.Contains(es[0].Detail, "undecoded") {
		t.Errorf("%d entries, the first %.200s: want 100, undecoded", len(es), es[0].Detail)
	}
}

// TestUploadListHeldBounded: a tenant's multipart upload sends 10,000
// files (the agent's most), each named by a path of 4,000 bytes, and
// holds the rest of its body back. The trail lists an upload's files
// until it ends; expected: what it holds of them is bounded (its heap
// grows by under 8 MiB), the files past that bound are counted, not
// listed. Found by review, 2026-12-04: every file's path and hash were
// kept to the end, some 45 MiB of the daemon for 40 MB sent, held for
// as long as the client liked, for each of a key's requests in flight.
func TestUploadListHeldBounded(t *testing.T) {
	tr := startTrail(t, Limits{})
	pr, pw := io.Pipe()
	r := httptest.NewRequest(http.MethodPost, "/files?username=user", pr)
	r.Header.Set("Content-Type", "multipart/form-data; boundary=BOUNDARY")
	_, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
	agentRead := make(chan error, 1)
	go func() { // the agent, reading the upload as it comes
		_, err := io.Copy(io.Discard, r.Body)
		agentRead <- err
	}()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	const files = 10000
	dir := "/home/user/" + strings.Repeat("d", 250) + "/"
	for i := range files {
		name := dir + strings.Repeat("f", 3700) + itoa(int64(i))
		if _, err := io.WriteString(pw, "--BOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename=\""+name+"\"\r\n\r\nx\r\n"); err != nil {
			t.Fatal(err)
		}
	}
	_, _ = io.WriteString(pw, "--BOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/last\"\r\n\r\n")
	time.Sleep(200 * time.Millisecond) // the parser has read what was sent
	runtime.GC()
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("heap grown by %d bytes with %d files of 4 KB paths listed, the upload held open", grown, files)
	if grown > 8<<20 {
		t.Errorf("the daemon's heap grew by %d MiB holding an upload's list of files, want under 8 MiB", grown>>20)
	}
	pw.CloseWithError(io.ErrUnexpectedEOF)
	<-agentRead
	done()
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1", Limit: files + 10})
	if err != nil {
		t.Fatal(err)
	}
	more := false
	for _, e := range es {
		if strings.Contains(e.Detail, "more files in the upload are not listed") {
			more = true
		}
	}
	if !more {
		t.Errorf("%d entries and none counts the files past the bound", len(es))
	}
}
