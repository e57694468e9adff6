package audit

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// fakeAgent answers as an agent does: Start streams a start event, output
// larger than the scanner decodes and small, then an end event.
type fakeAgent struct {
	processconnect.UnimplementedProcessHandler
	filesystemconnect.UnimplementedFilesystemHandler
}

func (fakeAgent) Start(_ context.Context, req *connect.Request[pb.StartRequest], s *connect.ServerStream[pb.StartResponse]) error {
	if req.Msg.GetProcess().GetCmd() == "missing" {
		return connect.NewError(connect.CodeNotFound, io.EOF)
	}
	ev := func(e *pb.ProcessEvent) error { return s.Send(&pb.StartResponse{Event: e}) }
	if err := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 42}}}); err != nil {
		return err
	}
	big := bytes.Repeat([]byte(`"end" `), 30000) // a data event that looks like an end to a careless scanner
	for _, out := range [][]byte{big, []byte("small")} {
		if err := ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: &pb.ProcessEvent_DataEvent{
			Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: out}}}}); err != nil {
			return err
		}
	}
	return ev(&pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{ExitCode: 7, Exited: true,
		Status: "exit status 7", Reason: "oom"}}})
}

func (fakeAgent) SendSignal(context.Context, *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

func (fakeAgent) Remove(_ context.Context, req *connect.Request[fspb.RemoveRequest]) (*connect.Response[fspb.RemoveResponse], error) {
	if req.Msg.GetPath() == "/nope" {
		return nil, connect.NewError(connect.CodeNotFound, io.EOF)
	}
	return connect.NewResponse(&fspb.RemoveResponse{}), nil
}

func (fakeAgent) Move(context.Context, *connect.Request[fspb.MoveRequest]) (*connect.Response[fspb.MoveResponse], error) {
	return connect.NewResponse(&fspb.MoveResponse{}), nil
}

// setup is an agent behind a proxy that observes as cage's does
// (proxy.Proxy: Observe before forwarding, the response to ModifyResponse,
// done when the request is over).
func setup(t *testing.T) (*Trail, string) {
	t.Helper()
	return setupWith(t, fakeAgent{})
}

// setupWith is setup with process as the agent's process service.
func setupWith(t *testing.T, process processconnect.ProcessHandler) (*Trail, string) {
	t.Helper()
	tr := startTrail(t, Limits{})
	mux := http.NewServeMux()
	mux.Handle(processconnect.NewProcessHandler(process))
	mux.Handle(filesystemconnect.NewFilesystemHandler(fakeAgent{}))
	mux.HandleFunc("/files", func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			_, _ = w.Write(bytes.Repeat([]byte("x"), 1000))
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Write([]byte("[]"))
	})
	mux.HandleFunc("/cage/kill", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	agent := httptest.NewServer(mux)
	t.Cleanup(agent.Close)
	target, _ := url.Parse(agent.URL)
	px := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		port, _ := strconv.Atoi(r.Header.Get("E2b-Sandbox-Port"))
		if port == 0 {
			port = envdPort
		}
		observed, done := tr.ObserveEnvd(r, "sb1", "key1", port)
		if done != nil {
			defer done()
		}
		rp := httputil.NewSingleHostReverseProxy(target)
		rp.FlushInterval = -1
		rp.ModifyResponse = func(resp *http.Response) error {
			if observed != nil {
				observed(resp)
			}
			return nil
		}
		// As cage's proxy: a stream answers before its request's body is
		// read whole. Without it net/http's server reads (and drops) what
		// is left of the body as the answer's header goes, while the proxy
		// still copies it upstream: now and then the copy ended early and
		// the answer was cut (TestEnvdProcess/proto, 1 run in about 200).
		_ = http.NewResponseController(w).EnableFullDuplex()
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(px.Close)
	return tr, px.URL
}

// entriesOf returns the entries of a kind once there are want of them (a
// call's entry is recorded once the proxy is done with it, which may be
// after its client has the answer), or after five seconds.
func entriesOf(t *testing.T, tr *Trail, kind string, want int) []map[string]any {
	t.Helper()
	var es []Entry
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		tr.Flush()
		var err error
		if es, err = tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1", Kinds: []string{kind}}); err != nil {
			t.Fatal(err)
		}
		if len(es) >= want || time.Now().After(deadline) {
			break
		}
	}
	var out []map[string]any
	for _, e := range es {
		var d map[string]any
		if err := json.Unmarshal([]byte(e.Detail), &d); err != nil {
			t.Fatal(err)
		}
		d["_source"], d["_status"] = e.Source, float64(e.Status)
		out = append(out, d)
	}
	return out
}

// A process started through the proxy, by Connect clients in JSON (as the
// JS SDK) and in protobuf, gzip or not: its argv, user, cwd and
// environment names from the request, the pid and its end from the agent.
func TestEnvdProcess(t *testing.T) {
	for _, c := range []struct {
		name string
		opts []connect.ClientOption
	}{{"json", []connect.ClientOption{connect.WithProtoJSON()}}, {"proto", nil},
		{"proto gzip", []connect.ClientOption{connect.WithSendGzip()}}, {"grpc", []connect.ClientOption{connect.WithGRPC()}}} {
		t.Run(c.name, func(t *testing.T) {
			tr, px := setup(t)
			cl := processconnect.NewProcessClient(http.DefaultClient, px, c.opts...)
			cwd := "/home/user"
			req := connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/bash",
				Args: []string{"-l", "-c", "echo secret-free"}, Envs: map[string]string{"TOKEN": "hunter2", "A": "1"}, Cwd: &cwd}})
			req.Header().Set("Authorization", "Basic dXNlcjo=") // user:
			st, err := cl.Start(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			for st.Receive() {
			}
			if err := st.Err(); err != nil {
				t.Fatal(err)
			}
			st.Close()
			starts, ends := entriesOf(t, tr, KindProcessStart, 1), entriesOf(t, tr, KindProcessEnd, 1)
			if len(starts) != 1 || len(ends) != 1 {
				t.Fatalf("starts %v, ends %v", starts, ends)
			}
			s, e := starts[0], ends[0]
			argv, _ := json.Marshal(s["argv"])
			if string(argv) != `["/bin/bash","-l","-c","echo secret-free"]` || s["user"] != "user" || s["cwd"] != cwd ||
				s["_source"] != SourceHost || s["agent"].(map[string]any)["pid"] != float64(42) {
				t.Errorf("start %v", s)
			}
			if names, _ := json.Marshal(s["env_names"]); string(names) != `["A","TOKEN"]` || strings.Contains(mustJSON(s), "hunter2") {
				t.Errorf("start %v: want the environment's names, never its values", s)
			}
			if e["exit_code"] != float64(7) || e["reason"] != "oom" || e["pid"] != float64(42) || e["_source"] != SourceAgent || e["call"] != s["call"] {
				t.Errorf("end %v (start %v)", e, s)
			}
		})
	}
}

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }

// A start the agent refuses is recorded as not started, with the error.
func TestEnvdProcessRefused(t *testing.T) {
	tr, px := setup(t)
	cl := processconnect.NewProcessClient(http.DefaultClient, px, connect.WithProtoJSON())
	st, err := cl.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "missing"}}))
	if err == nil {
		for st.Receive() {
		}
		st.Close()
	}
	starts := entriesOf(t, tr, KindProcessStart, 1)
	if len(starts) != 1 || starts[0]["started"] != false || !strings.Contains(mustJSON(starts[0]), "not_found") {
		t.Fatalf("starts %v", starts)
	}
}

func TestEnvdUnaryCalls(t *testing.T) {
	tr, px := setup(t)
	fs := filesystemconnect.NewFilesystemClient(http.DefaultClient, px, connect.WithProtoJSON())
	if _, err := fs.Remove(context.Background(), connect.NewRequest(&fspb.RemoveRequest{Path: "/home/user/x"})); err != nil {
		t.Fatal(err)
	}
	if _, err := fs.Remove(context.Background(), connect.NewRequest(&fspb.RemoveRequest{Path: "/nope"})); err == nil {
		t.Fatal("remove /nope succeeded")
	}
	fsp := filesystemconnect.NewFilesystemClient(http.DefaultClient, px)
	if _, err := fsp.Move(context.Background(), connect.NewRequest(&fspb.MoveRequest{Source: "/a", Destination: "/b"})); err != nil {
		t.Fatal(err)
	}
	pc := processconnect.NewProcessClient(http.DefaultClient, px)
	if _, err := pc.SendSignal(context.Background(), connect.NewRequest(&pb.SendSignalRequest{
		Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 42}}, Signal: pb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	rm := entriesOf(t, tr, KindFileRm, 2)
	if len(rm) != 2 || rm[0]["path"] != "/home/user/x" || rm[0]["_status"] != float64(200) || rm[1]["path"] != "/nope" || rm[1]["_status"] != float64(404) {
		t.Errorf("removes %v", rm)
	}
	if mv := entriesOf(t, tr, KindFileMove, 1); len(mv) != 1 || mv[0]["source"] != "/a" || mv[0]["destination"] != "/b" {
		t.Errorf("moves %v", mv)
	}
	if sig := entriesOf(t, tr, KindProcessSignal, 1); len(sig) != 1 || sig[0]["signal"] != "SIGNAL_SIGKILL" || sig[0]["pid"] != float64(42) {
		t.Errorf("signals %v", sig)
	}
	// Reads of state are not recorded; other calls are.
	for _, path := range []string{"/filesystem.Filesystem/Stat", "/health"} {
		resp, err := http.Post(px+path, "application/json", strings.NewReader("{}"))
		if err == nil {
			resp.Body.Close()
		}
	}
	resp, err := http.Post(px+"/cage/kill", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if calls := entriesOf(t, tr, "envd", 1); len(calls) != 1 || calls[0]["path"] != "/cage/kill" || calls[0]["_status"] != float64(204) {
		t.Errorf("envd calls %v", calls)
	}
	if all := entriesOf(t, tr, "file", 3); len(all) != 3 {
		t.Errorf("file entries %v", all)
	}
}

func sum(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// Uploads: each file's path, size and SHA-256 as it passed, multipart (the
// SDK) and octet-stream; a compressed one hashed as sent, never inflated
// by the host.
func TestEnvdUploads(t *testing.T) {
	tr, px := setup(t)
	one, two := bytes.Repeat([]byte("a"), 3<<20), []byte("second file")
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	for _, f := range []struct {
		name string
		data []byte
	}{{"/home/user/one.bin", one}, {"dir/two.txt", two}} {
		w, _ := mw.CreateFormFile("file", f.name)
		w.Write(f.data)
	}
	mw.Close()
	post := func(q, ctype string, hdr map[string]string, b io.Reader) {
		req, _ := http.NewRequest(http.MethodPost, px+"/files?"+q, b)
		req.Header.Set("Content-Type", ctype)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	post("username=user", mw.FormDataContentType(), nil, &body)
	post("path=/tmp/raw&username=root", "application/octet-stream", nil, bytes.NewReader(two))
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(one)
	zw.Close()
	sent := gz.Bytes()
	post("path=/tmp/z", "application/octet-stream", map[string]string{"Content-Encoding": "gzip"}, bytes.NewReader(sent))
	ws := entriesOf(t, tr, KindFileWrite, 4)
	if len(ws) != 4 {
		t.Fatalf("writes %v", ws)
	}
	byPath := map[string]map[string]any{}
	for _, w := range ws {
		byPath[w["path"].(string)] = w
	}
	for _, w := range []struct {
		path, user, hash string
		size             int
	}{{"/home/user/one.bin", "user", sum(one), len(one)}, {"dir/two.txt", "user", sum(two), len(two)}, {"/tmp/raw", "root", sum(two), len(two)}} {
		got := byPath[w.path]
		if got["user"] != w.user || got["sha256"] != w.hash || got["size"] != float64(w.size) || got["_status"] != float64(200) {
			t.Errorf("write of %s: %v; want %+v", w.path, got, w)
		}
	}
	if z := byPath["/tmp/z"]; z["encoding"] != "gzip" || z["sent_sha256"] != sum(sent) || z["sent_size"] != float64(len(sent)) || z["sha256"] != nil {
		t.Errorf("compressed write %v", z)
	}
	resp, err := http.Get(px + "/files?path=/etc/hostname&username=user")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if rd := entriesOf(t, tr, KindFileRead, 1); len(rd) != 1 || rd[0]["path"] != "/etc/hostname" || rd[0]["bytes"] != float64(1000) {
		t.Errorf("reads %v", rd)
	}
}

// An upload the client abandons half-way: recorded incomplete, and nothing
// of the observer is left waiting.
func TestEnvdUploadAbandoned(t *testing.T) {
	tr, px := setup(t)
	pr, pw := io.Pipe()
	req, _ := http.NewRequest(http.MethodPost, px+"/files?path=/tmp/half", pr)
	req.Header.Set("Content-Type", "application/octet-stream")
	req.ContentLength = 1 << 20
	go func() {
		pw.Write(bytes.Repeat([]byte("h"), 1000))
		pw.CloseWithError(io.ErrUnexpectedEOF)
	}()
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	ws := entriesOf(t, tr, KindFileWrite, 1)
	if len(ws) != 1 || ws[0]["complete"] != false {
		t.Fatalf("writes %v", ws)
	}
}

// The code interpreter's POST /execute: the code, bounded, its hash.
func TestEnvdCodeRun(t *testing.T) {
	tr, px := setup(t)
	code := "print(1)\n" + strings.Repeat("#", 10000)
	b, _ := json.Marshal(map[string]string{"code": code, "language": "python"})
	req, _ := http.NewRequest(http.MethodPost, px+"/execute", bytes.NewReader(b))
	req.Header.Set("E2b-Sandbox-Port", "49999")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	cs := entriesOf(t, tr, KindCodeRun, 1)
	if len(cs) != 1 || cs[0]["code_sha256"] != sum([]byte(code)) || cs[0]["code_bytes"] != float64(len(code)) ||
		!strings.HasPrefix(cs[0]["code"].(string), "print(1)") || len(cs[0]["code"].(string)) > maxCodeKept+20 || cs[0]["language"] != "python" {
		t.Fatalf("code runs %v", cs)
	}
}
