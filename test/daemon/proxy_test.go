package daemontest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
)

// TestProxy reaches a sandbox's agent through the daemon's proxy: routed by
// E2B's headers and by host name, guarded by the sandbox's access token,
// streaming as it goes, and with E2B's errors for what is not there.
func TestProxy(t *testing.T) {
	t.Parallel()
	const domain = "test.local"
	d := startDaemon(t, "--domain", domain)
	sb := d.create(t, d.key, map[string]any{"envVars": map[string]string{"FOO": "proxied env"}})
	id, token := sb.SandboxID, sb.EnvdAccessToken

	t.Run("headers", func(t *testing.T) {
		ac := d.agent(id, token)
		defer ac.Close()
		if out := mustRun(t, ac, "echo $FOO"); out != "proxied env\n" {
			t.Errorf("echo $FOO: %q, want the envVars value", out)
		}
	})

	t.Run("host", func(t *testing.T) {
		ac := d.hostAgent(t, id, token, domain)
		if out := mustRun(t, ac, "echo $FOO"); out != "proxied env\n" {
			t.Errorf("echo $FOO routed by Host %s-%s.%s: %q", envdPort, id, domain, out)
		}
		// Files too, by host.
		upload(t, ac, "/tmp/by-host.txt", []byte("host routed\n"))
		if got := download(t, ac, "/tmp/by-host.txt"); string(got) != "host routed\n" {
			t.Errorf("GET /files by host: %q", got)
		}
		// A host under another domain is not routed to the sandbox: the
		// proxy's 400 (a routed /health would be the agent's 204).
		r := d.proxyGet(t, "/health", map[string]string{}, envdPort+"-"+id+".other.example")
		if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "no sandbox named") {
			t.Errorf("Host %s-%s.other.example (daemon's domain %s): %v, want the proxy's 400", envdPort, id, domain, r)
		}
		if r := d.proxyGet(t, "/health", map[string]string{}, envdPort+"-"+id+"."+domain); r.status != http.StatusNoContent {
			t.Errorf("Host %s-%s.%s /health: %v, want the agent's 204", envdPort, id, domain, r)
		}
	})

	t.Run("token", func(t *testing.T) {
		for name, tok := range map[string]string{"wrong": strings.Repeat("0", len(token)), "missing": ""} {
			ac := d.agent(id, tok)
			r := run(ac, "echo should not run")
			ac.Close()
			if !isUnauthenticated(r.err) || r.stdout != "" {
				t.Errorf("%s access token through the proxy: err %v, stdout %q; want unauthenticated", name, r.err, r.stdout)
			}
			hac := d.hostAgent(t, id, tok, domain)
			if r := run(hac, "echo should not run"); !isUnauthenticated(r.err) {
				t.Errorf("%s access token, routed by host: err %v; want unauthenticated", name, r.err)
			}
			// And plain HTTP: 401.
			h := map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": envdPort}
			if tok != "" {
				h["X-Access-Token"] = tok
			}
			if r := d.proxyGet(t, "/files?path=/etc/hostname", h, ""); r.status != http.StatusUnauthorized {
				t.Errorf("GET /files with a %s access token: %v, want 401", name, r)
			}
		}
	})

	t.Run("unknown sandbox", func(t *testing.T) {
		for _, bad := range []string{"0123456789abcdef0123", "nosuchsandbox"} {
			r := d.proxyGet(t, "/health", map[string]string{"E2b-Sandbox-Id": bad, "E2b-Sandbox-Port": envdPort}, "")
			checkProxyError(t, r, bad, "The sandbox was not found")
			r = d.proxyGet(t, "/health", nil, envdPort+"-"+bad+"."+domain)
			checkProxyError(t, r, bad, "The sandbox was not found")
		}
	})

	t.Run("closed port", func(t *testing.T) {
		// (49999, the code interpreter's, asks for the access token first.)
		r := d.proxyGet(t, "/", map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "49998"}, "")
		checkProxyError(t, r, id, "The sandbox is running but port is not open")
		r = d.proxyGet(t, "/", nil, "49998-"+id+"."+domain)
		checkProxyError(t, r, id, "The sandbox is running but port is not open")
	})

	t.Run("streaming", func(t *testing.T) {
		ac := d.agent(id, token)
		defer ac.Close()
		w := &arrivals{}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		start := time.Now()
		end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh",
			Args:   []string{"-c", "for i in 1 2 3 4 5 6 7 8 9 10; do echo line$i; sleep 0.2; done"},
			Stdout: w, Stderr: io.Discard})
		finished := time.Now()
		if err != nil || end.GetExitCode() != 0 {
			t.Fatalf("streaming command: exit %d, err %v", end.GetExitCode(), err)
		}
		var want strings.Builder
		for i := 1; i <= 10; i++ {
			fmt.Fprintf(&want, "line%d\n", i)
		}
		if got := w.text(); got != want.String() {
			t.Errorf("streamed output %q, want %q", got, want.String())
		}
		first, chunks := w.first(), w.count()
		t.Logf("first output after %v, %d chunks, end after %v", first.Sub(start), chunks, finished.Sub(start))
		// The command prints for about 2 s: the first line must arrive long
		// before the end, not all at once when the process exits.
		if finished.Sub(first) < time.Second {
			t.Errorf("the first line arrived %v before the end of a 2 s stream: the proxy buffers", finished.Sub(first))
		}
		if chunks < 5 {
			t.Errorf("10 lines printed 200 ms apart arrived in %d pieces, want them as they come", chunks)
		}
	})

	t.Run("files", func(t *testing.T) {
		ac := d.agent(id, token)
		defer ac.Close()
		data := make([]byte, 3<<20+17)
		_, _ = rand.Read(data)
		upload(t, ac, "/tmp/blob.bin", data)
		if got := download(t, ac, "/tmp/blob.bin"); !bytes.Equal(got, data) {
			t.Errorf("GET /files returned %d bytes, want the %d uploaded", len(got), len(data))
		}
		if out := mustRun(t, ac, "wc -c < /tmp/blob.bin"); strings.TrimSpace(out) != "3145745" {
			t.Errorf("the uploaded file in the sandbox: wc -c %q", out)
		}
		// Multipart, as the E2B SDKs upload.
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		fw, _ := mw.CreateFormFile("file", "multi.txt")
		_, _ = fw.Write([]byte("multipart content\n"))
		mw.Close()
		q := url.Values{"path": {"/tmp/multi.txt"}, "username": {"user"}}
		req, _ := http.NewRequest(http.MethodPost, agentclient.BaseURL+"/files?"+q.Encode(), &body)
		req.Header.Set("Content-Type", mw.FormDataContentType())
		resp, err := ac.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		reply, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("multipart POST /files: %d %s", resp.StatusCode, reply)
		}
		if got := download(t, ac, "/tmp/multi.txt"); string(got) != "multipart content\n" {
			t.Errorf("multipart upload read back: %q", got)
		}
		// A file that is not there: the agent's 404, passed through.
		q = url.Values{"path": {"/tmp/no-such-file"}, "username": {"user"}}
		req, _ = http.NewRequest(http.MethodGet, agentclient.BaseURL+"/files?"+q.Encode(), nil)
		resp, err = ac.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET /files of a missing file: %d, want 404", resp.StatusCode)
		}
	})

	t.Run("killed sandbox", func(t *testing.T) {
		gone := d.create(t, d.key, nil)
		ac := d.agent(gone.SandboxID, gone.EnvdAccessToken)
		defer ac.Close()
		mustRun(t, ac, "true")
		d.kill(t, d.key, gone.SandboxID)
		r := d.proxyGet(t, "/health", map[string]string{"E2b-Sandbox-Id": gone.SandboxID, "E2b-Sandbox-Port": envdPort}, "")
		checkProxyError(t, r, gone.SandboxID, "The sandbox was not found")
	})
}

// proxyGet sends GET path to the proxy with headers and, when not "", Host.
func (d *daemon) proxyGet(t *testing.T, path string, headers map[string]string, host string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, d.proxyURL()+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := d.http.Do(req)
	if err != nil {
		t.Fatalf("GET %s through the proxy: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	noStack(t, "proxy response", string(body))
	return reply{status: resp.StatusCode, header: resp.Header, body: body}
}

// checkProxyError checks E2B's proxy error: 502 with exactly
// {"sandboxId": id, "message": msg, "code": 502}.
func checkProxyError(t *testing.T, r reply, id, msg string) {
	t.Helper()
	if r.status != http.StatusBadGateway {
		t.Errorf("proxy for sandbox %s: %v, want 502 %q", id, r, msg)
		return
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("proxy 502: Content-Type %q, want JSON", ct)
	}
	var got map[string]any
	if err := json.Unmarshal(r.body, &got); err != nil {
		t.Errorf("proxy 502 body %q: %v", r.body, err)
		return
	}
	want := map[string]any{"sandboxId": id, "message": msg, "code": float64(502)}
	if len(got) != len(want) {
		t.Errorf("proxy 502 body %s, want exactly %v", r.body, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("proxy 502 body %s: %s is %v, want %v", r.body, k, got[k], v)
		}
	}
}

// arrivals records what was written and when each write came.
type arrivals struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	times []time.Time
}

func (a *arrivals) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.times = append(a.times, time.Now())
	return a.buf.Write(p)
}

func (a *arrivals) text() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.buf.String()
}

func (a *arrivals) first() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.times) == 0 {
		return time.Time{}
	}
	return a.times[0]
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.times)
}
