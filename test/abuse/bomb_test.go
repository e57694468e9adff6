package abuse

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	procpb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// unaryRPCs are every unary method of the agent's two services, read from
// their descriptors, so a method added later is attacked too.
func unaryRPCs() []string {
	var out []string
	for _, fd := range []protoreflect.FileDescriptor{procpb.File_process_process_proto, fspb.File_filesystem_filesystem_proto} {
		svcs := fd.Services()
		for i := 0; i < svcs.Len(); i++ {
			ms := svcs.Get(i).Methods()
			for j := 0; j < ms.Len(); j++ {
				if m := ms.Get(j); !m.IsStreamingClient() && !m.IsStreamingServer() {
					out = append(out, fmt.Sprintf("/%s/%s", svcs.Get(i).FullName(), m.Name()))
				}
			}
		}
	}
	return out
}

// gzipOfZeros is n bytes of zeros, gzipped (about n/1000 bytes).
func gzipOfZeros(n int64) []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	_, _ = io.CopyN(zw, zeros{}, n)
	zw.Close()
	return b.Bytes()
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// bomb is one attack body.
type bomb struct {
	name     string
	body     func() io.Reader
	gzipped  bool
	inflated int64 // bytes it stands for
}

// TestBodyBombs sends every unary RPC, /files and /envs of a sandbox's
// agent a body bomb through the proxy: 1 GiB of zeros gzipped into about a
// megabyte, and 64 MiB of plain zeros. Without the access token (the
// sandbox's id alone, which every shared link shows), each must get 401
// without the body reaching the agent; before the fix one such request took
// the agent to 2.1 GB and ended the sandbox. With the token, each is refused
// by the agent's read limits. Either way the agent's memory stays bounded
// and the sandbox lives on.
func TestBodyBombs(t *testing.T) {
	d := cageserve.Start(t)
	// The disk (a tmpfs, counted in the memory) well under the memory: an
	// upload that fills it gets 507, and the sandbox lives on.
	sb := d.Create(t, d.Key, map[string]any{"memoryMB": 512, "diskSizeMB": 32, "timeout": 600})
	pid, err := cageserve.AgentPID(sb.SandboxID)
	if err != nil {
		t.Fatal(err)
	}
	rss0, _, err := cageserve.Memory(pid)
	if err != nil {
		t.Fatal(err)
	}
	gz := gzipOfZeros(1 << 30)
	bombs := []bomb{
		{"gzip, 1 GiB inflated", func() io.Reader { return bytes.NewReader(gz) }, true, 1 << 30},
		{"plain, 64 MiB", func() io.Reader { return io.LimitReader(zeros{}, 64<<20) }, false, 64 << 20},
	}
	type target struct{ method, path, contentType string }
	var targets []target
	for _, rpc := range unaryRPCs() {
		targets = append(targets, target{"POST", rpc, "application/json"}, target{"POST", rpc, "application/proto"})
	}
	targets = append(targets, target{"POST", "/files?path=/tmp/bomb&username=user", "application/octet-stream"},
		target{"GET", "/envs", ""})
	send := func(tg target, b bomb, token string) (int, error) {
		var body io.Reader
		if tg.method == "POST" {
			body = b.body()
		}
		req, _ := http.NewRequest(tg.method, "http://"+d.Proxy+tg.path, body)
		req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
		if tg.contentType != "" {
			req.Header.Set("Content-Type", tg.contentType)
		}
		if b.gzipped {
			req.Header.Set("Content-Encoding", "gzip")
		}
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		resp, err := d.HTTP.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		return resp.StatusCode, nil
	}

	for _, b := range bombs {
		for _, tg := range targets {
			status, err := send(tg, b, "")
			// The proxy may also close the connection on an unread body
			// it will not forward; a status, when there is one, is 401.
			if err == nil && status != http.StatusUnauthorized {
				t.Errorf("%s %s %s, %s bomb, no token: %d, want 401", tg.method, tg.path, tg.contentType, b.name, status)
			}
		}
	}
	_, peakAnon, err := cageserve.Memory(pid)
	if err != nil {
		t.Fatalf("the agent is gone after unauthenticated bombs: %v", err)
	}
	t.Logf("agent memory: %.1f MiB before, peak %.1f MiB after %d unauthenticated bombs", mib(rss0), mib(peakAnon), len(targets)*len(bombs))
	if peakAnon-rss0 > 16<<20 {
		t.Errorf("unauthenticated bombs grew the agent's peak memory by %.1f MiB (bound 16 MiB): bodies reached it", mib(peakAnon-rss0))
	}

	// With the token: refused by the agent's limits, never a 2xx that
	// read it all, never a 500, and memory bounded.
	for _, b := range bombs {
		for _, tg := range targets {
			if tg.method == "GET" {
				continue
			}
			status, err := send(tg, b, sb.EnvdAccessToken)
			if err != nil {
				continue // a connection cut at the limit is a refusal
			}
			ok := status == http.StatusRequestEntityTooLarge || status == http.StatusTooManyRequests ||
				status == http.StatusBadRequest || status == http.StatusInsufficientStorage
			if !ok {
				t.Errorf("%s %s %s, %s bomb, with the token: %d, want a refusal (400, 413, 429 or 507)", tg.method, tg.path, tg.contentType, b.name, status)
			}
		}
	}
	_, peak, err := cageserve.Memory(pid)
	if err != nil {
		t.Fatalf("the agent is gone after authenticated bombs: %v", err)
	}
	t.Logf("agent memory: peak %.1f MiB after authenticated bombs", mib(peak))
	// The token holder owns the sandbox, and its agent may spend on one
	// request a few times its largest message (16 MiB, a process's stdin
	// chunk) before refusing it; never what the bomb inflates to (1 GiB).
	if peak-rss0 > 96<<20 {
		t.Errorf("authenticated bombs grew the agent's peak memory by %.1f MiB (bound 96 MiB)", mib(peak-rss0))
	}
	ac := d.Agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	if out, err := runSh(ac, "echo alive; ls /tmp | grep -c bomb || true"); err != nil || !strings.HasPrefix(out, "alive\n") {
		t.Errorf("the sandbox after the bombs: %q, %v; want it alive", out, err)
	}
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }
