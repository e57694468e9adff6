package daemontest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil"
)

// networkDetail is GET /sandboxes/{id}, for its network part.
type networkDetail struct{ types.SandboxDetail }

// internet is allowInternetAccess (false when absent).
func (n networkDetail) internet() bool { return n.AllowInternetAccess != nil && *n.AllowInternetAccess }

func (d *daemon) networkOf(t *testing.T, id string) networkDetail {
	t.Helper()
	r := d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + id, key: d.key})
	var n networkDetail
	r.decode(t, &n)
	return n
}

// pyFetch is a python HTTP GET of argv[1]: "OK:<body>" or "FAIL:<why>".
const pyFetch = `import urllib.request, sys
try:
    print("OK:" + urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as ex:
    print("FAIL:" + type(ex).__name__ + ":" + str(ex))`

// TestNetworkAPI drives a sandbox's network through the control API: E2B's
// default (the internet), an update to an allowlist, the records of what
// was allowed and denied, and the refusals of bad input.
func TestNetworkAPI(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	sb := d.create(t, d.key, nil) // E2B's default: the internet
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	get := func(url string) string {
		t.Helper()
		r := run(ac, fmt.Sprintf("python3 -c '%s' %s", pyFetch, url))
		return strings.TrimSpace(r.stdout)
	}
	n := d.networkOf(t, sb.SandboxID)
	if !n.internet() || n.Network.Mode != "internet" || n.Network.AllowPublicTraffic == nil || !*n.Network.AllowPublicTraffic {
		t.Errorf("default network: %+v, want the internet with public ports (E2B's defaults)", n)
	}
	if got := get("http://other.example.org/"); got != "OK:other "+testutil.OtherHost.String() {
		t.Errorf("internet: GET other.example.org: %q", got)
	}
	if got := get("http://169.254.169.254/"); strings.HasPrefix(got, "OK:") {
		t.Errorf("internet: metadata answered: %q", got)
	}

	// An allowlist, as E2B's SDK sends it.
	d.expect(t, http.StatusNoContent, call{method: "PUT", path: "/sandboxes/" + sb.SandboxID + "/network", key: d.key,
		body: map[string]any{"allowOut": []string{"allowed.example.com"}, "denyOut": []string{"0.0.0.0/0"}}})
	n = d.networkOf(t, sb.SandboxID)
	if n.internet() || n.Network.Mode != "allowlist" || !slices.Equal(n.Network.AllowOut, []string{"allowed.example.com"}) ||
		!slices.Equal(n.Network.DenyOut, []string{"0.0.0.0/0"}) {
		t.Errorf("after the update: %+v", n)
	}
	if got := get("http://allowed.example.com/"); !strings.HasPrefix(got, "OK:public") {
		t.Errorf("allowlist: GET allowed.example.com: %q", got)
	}
	if got := get("http://other.example.org/"); strings.HasPrefix(got, "OK:") {
		t.Errorf("allowlist: other.example.org answered: %q", got)
	}
	if got := get("http://" + testutil.OtherHost.String() + "/"); strings.HasPrefix(got, "OK:") {
		t.Errorf("allowlist: an address nobody allowed answered: %q", got)
	}

	// The records: the allowed name, the denied name, the refused address.
	r := d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + sb.SandboxID + "/network/records", key: d.key})
	var page types.NetworkRecords
	r.decode(t, &page)
	recs := page.Records
	has := func(kind, decision, name, dest string) bool {
		return slices.ContainsFunc(recs, func(x types.NetworkRecord) bool {
			return string(x.Kind) == kind && string(x.Decision) == decision && (name == "" || x.Name == name) && (dest == "" || x.Dest == dest) && x.Sandbox == sb.SandboxID
		})
	}
	for _, want := range [][4]string{
		{"dns", "allow", "allowed.example.com", ""},
		{"dns", "deny", "other.example.org", ""},
		{"connect", "deny", "", testutil.OtherHost.String() + ":80"},
		{"connect", "deny", "", "169.254.169.254:80"},
		{"connect", "allow", "", testutil.PublicHost.String() + ":80"},
	} {
		if !has(want[0], want[1], want[2], want[3]) {
			t.Errorf("no record %v among %d records", want, len(recs))
		}
	}

	// Bad input: a clear 400, and nothing changes.
	for name, body := range map[string]any{
		"IPv6 entry":         map[string]any{"allowOut": []string{"::1"}},
		"malformed name":     map[string]any{"allowOut": []string{"exa mple.com"}},
		"header rules":       map[string]any{"rules": map[string]any{"api.example.com": []any{}}},
		"unknown mode":       map[string]any{"mode": "everything"},
		"public traffic now": map[string]any{"allowPublicTraffic": false},
	} {
		r := d.do(t, call{method: "PUT", path: "/sandboxes/" + sb.SandboxID + "/network", key: d.key, body: body, invalid: true})
		if r.status != http.StatusBadRequest {
			t.Errorf("PUT network with %s: %v, want 400", name, r)
		}
		checkErrorBody(t, "PUT network "+name, r)
	}
	if n := d.networkOf(t, sb.SandboxID); n.Network.Mode != "allowlist" {
		t.Errorf("a refused update changed the network: %+v", n)
	}
	r = d.do(t, call{method: "PUT", path: "/sandboxes/0123456789abcdef0123/network", key: d.key, body: map[string]any{}})
	if r.status != http.StatusNotFound {
		t.Errorf("PUT network of an unknown sandbox: %v, want 404", r)
	}

	// Created with cage's mode none: no interface, so no rules to change.
	none := d.create(t, d.key, map[string]any{"network": map[string]any{"mode": "none"}})
	if n := d.networkOf(t, none.SandboxID); n.internet() || n.Network.Mode != "none" {
		t.Errorf("mode none: %+v", n)
	}
	r = d.do(t, call{method: "PUT", path: "/sandboxes/" + none.SandboxID + "/network", key: d.key,
		body: map[string]any{"allowOut": []string{"allowed.example.com"}}})
	if r.status != http.StatusConflict {
		t.Errorf("PUT network of a sandbox without one: %v, want 409", r)
	}
	// allow_internet_access false with an allowOut: an allowlist from the start.
	al := d.create(t, d.key, map[string]any{"allow_internet_access": false,
		"network": map[string]any{"allowOut": []string{testutil.OtherHost.String()}}})
	if n := d.networkOf(t, al.SandboxID); n.Network.Mode != "allowlist" || !slices.Equal(n.Network.AllowOut, []string{testutil.OtherHost.String()}) {
		t.Errorf("allow_internet_access false: %+v", n)
	}
	// A create with a bad entry is refused and leaves nothing.
	before := len(d.sandboxDirs())
	r = d.do(t, call{method: "POST", path: "/v2/sandboxes", key: d.key, invalid: true,
		body: map[string]any{"templateID": "host", "network": map[string]any{"allowOut": []string{"1.2.3.4/40"}}}})
	if r.status != http.StatusBadRequest {
		t.Errorf("create with a bad allowOut: %v, want 400", r)
	}
	if after := len(d.sandboxDirs()); after != before {
		t.Errorf("a refused create left a sandbox (%d -> %d)", before, after)
	}
}

// exposedServer is a python server for port 8000 on the sandbox's loopback
// only: "/" says which Host it was addressed by, "/stream" sends a chunk,
// waits for /tmp/go, then sends another, and a WebSocket upgrade echoes.
const exposedServer = `
import http.server, socketserver, os, time, hashlib, base64, struct
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/stream":
            self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            def chunk(b):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b)); self.wfile.flush()
            chunk(b"first\n")
            while not os.path.exists("/tmp/go"): time.sleep(0.02)
            chunk(b"second\n"); self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()
            return
        if self.headers.get("Upgrade", "").lower() == "websocket":
            acc = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
            self.send_response(101); self.send_header("Upgrade", "websocket"); self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", acc); self.end_headers(); self.wfile.flush()
            while True:
                h = self.rfile.read(2)
                if len(h) < 2: return
                op, n = h[0] & 15, h[1] & 127
                if n == 126: n = struct.unpack(">H", self.rfile.read(2))[0]
                elif n == 127: n = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4) if h[1] & 128 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
                if op == 8:
                    self.wfile.write(b"\x88\x02\x03\xe8"); self.wfile.flush(); return
                if op in (1, 2):
                    out = b"echo:" + data
                    self.wfile.write(bytes([128 | op, len(out)]) + out); self.wfile.flush()
        body = ("hello from 8000, host=%s" % self.headers.get("Host")).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 8000), H).serve_forever()
`

// startExposed starts exposedServer in the sandbox and waits until the
// proxy reaches it.
func (d *daemon) startExposed(t *testing.T, id, token string, headers map[string]string) {
	t.Helper()
	ac := d.agent(id, token)
	defer ac.Close()
	upload(t, ac, "/tmp/server.py", []byte(exposedServer))
	mustRun(t, ac, "nohup python3 /tmp/server.py >/tmp/server.log 2>&1 &")
	h := map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "8000"}
	for k, v := range headers {
		h[k] = v
	}
	if why := eventually(20*time.Second, func() string {
		if r := d.proxyGet(t, "/", h, ""); r.status != http.StatusOK {
			return r.String()
		}
		return ""
	}); why != "" {
		log, _ := ac.HTTP.Get("http://agent/files?path=/tmp/server.log")
		if log != nil {
			b, _ := io.ReadAll(log.Body)
			log.Body.Close()
			t.Logf("server log: %s", b)
		}
		t.Fatalf("the sandbox's server on port 8000 never answered through the proxy: %s", why)
	}
}

// TestExposedPorts reaches servers inside sandboxes through the proxy: by
// E2B's headers and by host, streaming, WebSocket, a closed port, and the
// traffic token of a sandbox whose ports are not public. The first sandbox
// has no network at all: ports are reached through its agent, not its
// interface.
func TestExposedPorts(t *testing.T) {
	t.Parallel()
	const domain = "ports.test"
	d := startDaemon(t, "--domain", domain)
	sb := d.create(t, d.key, map[string]any{"network": map[string]any{"mode": "none"}})
	id := sb.SandboxID
	d.startExposed(t, id, sb.EnvdAccessToken, nil)
	hdr := map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "8000"}

	t.Run("http", func(t *testing.T) {
		if r := d.proxyGet(t, "/", hdr, ""); r.status != http.StatusOK || !strings.HasPrefix(string(r.body), "hello from 8000") {
			t.Errorf("by headers: %v", r)
		}
		host := "8000-" + id + "." + domain
		r := d.proxyGet(t, "/", nil, host)
		if r.status != http.StatusOK || string(r.body) != "hello from 8000, host="+host {
			t.Errorf("by host %s: %v (the server should see the host it was addressed by)", host, r)
		}
	})

	t.Run("streaming", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodGet, d.proxyURL()+"/stream", nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := d.http.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		// The first chunk arrives while the server still waits for /tmp/go:
		// nothing is buffered on the way.
		first, err := br.ReadString('\n')
		if err != nil || first != "first\n" {
			t.Fatalf("first chunk: %q %v", first, err)
		}
		ac := d.agent(id, sb.EnvdAccessToken)
		defer ac.Close()
		mustRun(t, ac, "touch /tmp/go")
		second, err := br.ReadString('\n')
		if err != nil || second != "second\n" {
			t.Fatalf("second chunk: %q %v", second, err)
		}
	})

	t.Run("websocket", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		h := http.Header{}
		for k, v := range hdr {
			h.Set(k, v)
		}
		c, resp, err := websocket.Dial(ctx, "ws://"+d.proxy+"/ws", &websocket.DialOptions{HTTPHeader: h})
		if err != nil {
			t.Fatalf("websocket through the proxy: %v (%v)", err, resp)
		}
		defer c.CloseNow()
		for _, msg := range []string{"ping", "hello", strings.Repeat("x", 100)} {
			if err := c.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
				t.Fatal(err)
			}
			typ, got, err := c.Read(ctx)
			if err != nil || typ != websocket.MessageText || string(got) != "echo:"+msg {
				t.Fatalf("echo of %q: %q %v", msg, got, err)
			}
		}
		_ = c.Close(websocket.StatusNormalClosure, "")
	})

	t.Run("closed port", func(t *testing.T) {
		r := d.proxyGet(t, "/", map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "8002"}, "")
		checkProxyError(t, r, id, "The sandbox is running but port is not open")
		r = d.proxyGet(t, "/", map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "70000"}, "")
		if r.status != http.StatusBadRequest {
			t.Errorf("port 70000: %v, want 400", r)
		}
	})

	t.Run("traffic token", func(t *testing.T) {
		priv := d.create(t, d.key, map[string]any{"network": map[string]any{"allowPublicTraffic": false}})
		if priv.TrafficAccessToken == nil || len(*priv.TrafficAccessToken) < 32 {
			t.Fatalf("trafficAccessToken: %v", priv.TrafficAccessToken)
		}
		tok := *priv.TrafficAccessToken
		d.startExposed(t, priv.SandboxID, priv.EnvdAccessToken, map[string]string{"E2b-Traffic-Access-Token": tok})
		h := map[string]string{"E2b-Sandbox-Id": priv.SandboxID, "E2b-Sandbox-Port": "8000"}
		for name, v := range map[string]string{"missing": "", "wrong": strings.Repeat("0", len(tok)), "other sandbox's envd token": sb.EnvdAccessToken} {
			hh := map[string]string{"E2b-Sandbox-Id": priv.SandboxID, "E2b-Sandbox-Port": "8000"}
			if v != "" {
				hh["E2b-Traffic-Access-Token"] = v
			}
			if r := d.proxyGet(t, "/", hh, ""); r.status != http.StatusForbidden {
				t.Errorf("%s traffic token: %v, want 403", name, r)
			}
		}
		h["E2b-Traffic-Access-Token"] = tok
		if r := d.proxyGet(t, "/", h, ""); r.status != http.StatusOK {
			t.Errorf("with the traffic token: %v", r)
		}
		// The agent's own port is guarded by the access token, not this one.
		ac := d.agent(priv.SandboxID, priv.EnvdAccessToken)
		defer ac.Close()
		if out := mustRun(t, ac, "echo ok"); out != "ok\n" {
			t.Errorf("envd through the proxy: %q", out)
		}
	})
}
