package agent

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// bombSize is what the test bombs inflate to: far beyond any limit of the
// agent, small enough that the old agent's failure stays survivable here.
const bombSize = 256 << 20

// gzipBomb is bombSize zero bytes, gzip-compressed (about 250 KiB).
var gzipBomb = sync.OnceValue(func() []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	zero := make([]byte, 1<<20)
	for range bombSize >> 20 {
		zw.Write(zero)
	}
	zw.Close()
	return b.Bytes()
})

// allProcedures lists every RPC of both services, with whether the client
// streams (a Connect "streaming" content type) or not.
func allProcedures() map[string]bool {
	procs := map[string]bool{}
	for _, fd := range []protoreflect.FileDescriptor{pb.File_process_process_proto, fspb.File_filesystem_filesystem_proto} {
		svcs := fd.Services()
		for i := range svcs.Len() {
			ms := svcs.Get(i).Methods()
			for j := range ms.Len() {
				m := ms.Get(j)
				procs["/"+string(svcs.Get(i).FullName())+"/"+string(m.Name())] = m.IsStreamingClient() || m.IsStreamingServer()
			}
		}
	}
	return procs
}

func newAuthServer(t *testing.T, tweak func(*Config)) (*Server, *httptest.Server) {
	t.Helper()
	root := t.TempDir()
	os.Chmod(root, 0o755)
	os.MkdirAll(root+"/home/user", 0o755)
	passwd := t.TempDir() + "/passwd"
	os.WriteFile(passwd, []byte(fmt.Sprintf("user:x:%d:%d::/home/user:/bin/sh\n", os.Getuid(), os.Getgid())), 0o644)
	cfg := Config{Root: root, Passwd: passwd, Group: passwd, Token: fsTestToken}
	if tweak != nil {
		tweak(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		srv.Close()
		s.Shutdown(context.Background())
	})
	return s, srv
}

// rawPrefix sends a request whose headers promise a 1 GiB body, and only
// the first 64 KiB of it (a gzip bomb's), then waits for the answer: an
// agent that reads the body before it checks the token never answers.
func rawPrefix(t *testing.T, addr, method, target string, hdr map[string]string) (*http.Response, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var req strings.Builder
	fmt.Fprintf(&req, "%s %s HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\n", method, target, 1<<30)
	for k, v := range hdr {
		fmt.Fprintf(&req, "%s: %s\r\n", k, v)
	}
	req.WriteString("\r\n")
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(conn, req.String()); err != nil {
		return nil, err
	}
	if _, err := conn.Write(gzipBomb()[:64<<10]); err != nil {
		return nil, err
	}
	return http.ReadResponse(bufio.NewReader(conn), nil)
}

// TestUnauthenticatedBodyNotRead: a request without the token, to any RPC
// of either service (Connect and gRPC), to /files, /envs or a CONNECT,
// promising a 1 GiB gzip body and sending 64 KiB of it, is answered 401 (a
// gRPC unauthenticated status) at once: the agent reads no body before it
// knows who is asking. The old agent read the whole unary body first (no
// answer: the test times out).
func TestUnauthenticatedBodyNotRead(t *testing.T) {
	_, srv := newAuthServer(t, nil)
	addr := srv.Listener.Addr().String()
	type probe struct {
		method, target string
		hdr            map[string]string
	}
	var probes []probe
	for proc, streaming := range allProcedures() {
		ct, enc := "application/proto", "Content-Encoding"
		if streaming {
			ct, enc = "application/connect+proto", "Connect-Content-Encoding"
		}
		probes = append(probes,
			probe{"POST", proc, map[string]string{"Content-Type": ct, enc: "gzip"}},
			probe{"POST", proc, map[string]string{"Content-Type": "application/grpc", "Grpc-Encoding": "gzip", "X-Access-Token": "wrong"}})
	}
	probes = append(probes,
		probe{"POST", "/files?path=x", map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}},
		probe{"POST", "/files?path=x&signature=v1_AAAA", map[string]string{"Content-Type": "application/octet-stream"}},
		probe{"GET", "/envs", nil},
		probe{"POST", "/health", nil},
		probe{"CONNECT", "localhost:1", nil})
	for _, p := range probes {
		res, err := rawPrefix(t, addr, p.method, p.target, p.hdr)
		if err != nil {
			t.Errorf("%s %s %v: no answer before the body was sent: %v", p.method, p.target, p.hdr, err)
			continue
		}
		// Connect streams and gRPC carry the error in the body and trailers.
		body, _ := io.ReadAll(io.LimitReader(res.Body, 4<<10))
		res.Body.Close()
		streamDenied := res.StatusCode == 200 && strings.Contains(string(body), `"code":"unauthenticated"`)
		grpcDenied := res.StatusCode == 200 && (res.Header.Get("Grpc-Status") == "16" || res.Trailer.Get("Grpc-Status") == "16")
		if res.StatusCode != http.StatusUnauthorized && !streamDenied && !grpcDenied {
			t.Errorf("%s %s %v: status %d %v %q, want 401", p.method, p.target, p.hdr, res.StatusCode, res.Header, body)
		}
	}
	if res, err := http.Get(srv.URL + "/health"); err != nil || res.StatusCode != http.StatusNoContent {
		t.Errorf("GET /health without a token: %v %v", res, err)
	}
}

// heapDelta runs fn and returns how many bytes the process allocated on
// the heap meanwhile (all of it, freed or not).
func heapDelta(fn func()) uint64 {
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

func procStatus(field string) string {
	data, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// post sends body to the agent and returns the status and the Connect
// error code of the reply, if any.
func post(t *testing.T, srv *httptest.Server, target string, body []byte, hdr map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", srv.URL+target, bytes.NewReader(body))
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		t.Fatalf("POST %s: %v", target, err)
	}
	defer res.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	var ce struct{ Code string }
	json.Unmarshal(data, &ce)
	return res.StatusCode, ce.Code
}

// TestBodyBombMemory sends gzip bombs (256 MiB of zeros in 250 KiB) and
// oversized bodies, and bounds what the agent allocates for each: nothing
// to speak of without the token (the old agent inflated the whole bomb
// first: 256 MiB and more), at most a few times the message limit with it
// (refused as resource_exhausted / 413; the old agent had no limit).
func TestBodyBombMemory(t *testing.T) {
	_, srv := newAuthServer(t, func(c *Config) { c.MaxInflatedUpload = 1 << 20 })
	bomb := gzipBomb()
	unary := func(token string) map[string]string {
		h := map[string]string{"Content-Type": "application/proto", "Content-Encoding": "gzip"}
		if token != "" {
			h["X-Access-Token"] = token
		}
		return h
	}
	sendInput := func(n int) []byte {
		b, _ := proto.Marshal(&pb.SendInputRequest{Process: &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: 1}},
			Input: &pb.ProcessInput{Input: &pb.ProcessInput_Stdin{Stdin: make([]byte, n)}}})
		return b
	}
	cases := []struct {
		name     string
		target   string
		body     []byte
		hdr      map[string]string
		status   int
		code     string
		maxAlloc uint64
	}{
		{"no token, List bomb", processconnect.ProcessListProcedure, bomb, unary(""), 401, "unauthenticated", 8 << 20},
		{"no token, Stat bomb", "/filesystem.Filesystem/Stat", bomb, unary(""), 401, "unauthenticated", 8 << 20},
		{"token, List bomb", processconnect.ProcessListProcedure, bomb, unary(fsTestToken), 429, "resource_exhausted", 5 * maxProcessMessage},
		{"token, Stat bomb", "/filesystem.Filesystem/Stat", bomb, unary(fsTestToken), 429, "resource_exhausted", 8 << 20},
		{"token, SendInput over the limit", processconnect.ProcessSendInputProcedure, sendInput(maxProcessMessage + 1),
			map[string]string{"Content-Type": "application/proto", "X-Access-Token": fsTestToken}, 429, "resource_exhausted", 6 * maxProcessMessage},
		{"token, SendInput of half the limit", processconnect.ProcessSendInputProcedure, sendInput(maxProcessMessage / 2),
			map[string]string{"Content-Type": "application/proto", "X-Access-Token": fsTestToken}, 404, "not_found", 6 * maxProcessMessage},
		{"token, upload bomb", "/files?path=bomb", bomb, map[string]string{"Content-Type": "application/octet-stream",
			"Content-Encoding": "gzip", "X-Access-Token": fsTestToken}, 413, "", 8 << 20},
	}
	for _, c := range cases {
		rss := procStatus("VmRSS")
		var status int
		var code string
		alloc := heapDelta(func() { status, code = post(t, srv, c.target, c.body, c.hdr) })
		t.Logf("%s: %d %s; allocated %d MiB; RSS %s -> %s (peak %s)", c.name, status, code, alloc>>20, rss, procStatus("VmRSS"), procStatus("VmHWM"))
		if status != c.status || (c.code != "" && code != c.code) {
			t.Errorf("%s: %d %q, want %d %q", c.name, status, code, c.status, c.code)
		}
		if alloc > c.maxAlloc {
			t.Errorf("%s: the agent allocated %d MiB, want at most %d MiB", c.name, alloc>>20, c.maxAlloc>>20)
		}
	}
}

// TestUploadInflateLimit: a gzip-encoded upload inflating past the limit
// is refused with 413 and leaves nothing behind (multipart too); one of
// exactly the limit is written whole.
func TestUploadInflateLimit(t *testing.T) {
	s, srv := newAuthServer(t, func(c *Config) { c.MaxInflatedUpload = 1 << 20 })
	gz := func(data []byte) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Write(data)
		zw.Close()
		return b.Bytes()
	}
	hdr := map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip", "X-Access-Token": fsTestToken}
	if st, _ := post(t, srv, "/files?path=exact", gz(make([]byte, 1<<20)), hdr); st != 200 {
		t.Fatalf("upload of exactly the limit: %d", st)
	}
	if fi, err := os.Stat(s.cfg.Root + "/home/user/exact"); err != nil || fi.Size() != 1<<20 {
		t.Fatalf("exact upload: %v %v", fi, err)
	}
	if st, _ := post(t, srv, "/files?path=over", gz(make([]byte, 1<<20+1)), hdr); st != 413 {
		t.Fatalf("upload of one byte over the limit: %d", st)
	}
	var mp bytes.Buffer
	fmt.Fprintf(&mp, "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"mp\"\r\n\r\n%s\r\n--B--\r\n", make([]byte, 2<<20))
	hdr["Content-Type"] = "multipart/form-data; boundary=B"
	if st, _ := post(t, srv, "/files", gz(mp.Bytes()), hdr); st != 413 {
		t.Fatalf("multipart upload over the limit: %d", st)
	}
	ents, _ := os.ReadDir(s.cfg.Root + "/home/user")
	if len(ents) != 1 {
		t.Fatalf("left behind: %v", ents)
	}
}
