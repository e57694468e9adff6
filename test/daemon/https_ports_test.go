package daemontest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// tlsServer is a Python server for inside a sandbox: `tls.py PORT tls|plain`
// answers GET / with "secret over <mode> for <host>" (over TLS with a
// certificate made in the sandbox, recording the server name the client
// sent in /tmp/sni-PORT), and a WebSocket-style Upgrade with 101, then
// echoes the bytes it gets.
const tlsServer = `import http.server, ssl, sys
port, mode = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            while True:
                b = self.rfile.read1(4096)
                if not b:
                    return
                self.wfile.write(b)
                self.wfile.flush()
        body = ("secret over %s for %s" % (mode, self.headers.get("Host"))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = http.server.ThreadingHTTPServer(("0.0.0.0", port), H)
if mode == "tls":
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain("/tmp/tls/cert.pem", "/tmp/tls/key.pem")
    def sni(s, name, c):
        open("/tmp/sni-%d" % port, "w").write(name or "")
    ctx.sni_callback = sni
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
open("/tmp/up-%d" % port, "w").write("up")
srv.serve_forever()
`

// TestHTTPSPorts: E2B's network.httpsPorts. A port listed is reached over
// TLS (the sandbox's self-made certificate, the request's host as server
// name) while the client speaks plain HTTP to the proxy; a TLS server on a
// port not listed, and a plain one on a port listed, are a clear 502; the
// list is checked at create, shown by getInfo and fixed for the sandbox's
// life: kept across pause and resume, and a fork gets the source's.
func TestHTTPSPorts(t *testing.T) {
	t.Parallel()
	const domain = "test.local"
	d := startDaemon(t, "--domain", domain)

	t.Run("bad ports", func(t *testing.T) {
		many := make([]int, 65)
		for i := range many {
			many[i] = 8000 + i
		}
		for _, c := range []struct {
			ports []int
			want  string
		}{{[]int{49983}, "49983"}, {[]int{0}, "0"}, {[]int{65536}, "65536"}, {[]int{-1}, "-1"},
			{[]int{8443, 8443}, "8443"}, {many, "64"}} {
			r := d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/v2/sandboxes", key: d.key, invalid: true,
				body: map[string]any{"templateID": "host", "network": map[string]any{"httpsPorts": c.ports}}})
			checkErrorBody(t, fmt.Sprint("httpsPorts ", c.ports), r)
			if !strings.Contains(string(r.body), "httpsPorts") || !strings.Contains(string(r.body), c.want) {
				t.Errorf("httpsPorts %v: %s, want an error naming httpsPorts and %s", c.ports, r.body, c.want)
			}
		}
	})

	sb := d.create(t, d.key, map[string]any{"network": map[string]any{"httpsPorts": []int{8443, 8445}}})
	id := sb.SandboxID
	if got := d.get(t, d.key, id).Network.HTTPSPorts; !slices.Equal(got, []int{8443, 8445}) {
		t.Errorf("getInfo network.httpsPorts %v, want [8443 8445]", got)
	}
	ac := d.agent(id, sb.EnvdAccessToken)
	defer ac.Close()
	upload(t, ac, "/tmp/tls.py", []byte(tlsServer))
	mustRun(t, ac, `mkdir -p /tmp/tls && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=sandbox `+
		`-keyout /tmp/tls/key.pem -out /tmp/tls/cert.pem 2>/dev/null && `+
		`for a in "8443 tls" "8444 tls" "8445 plain"; do nohup python3 /tmp/tls.py $a >/tmp/tls.log 2>&1 & done; `+
		`for i in $(seq 100); do [ -e /tmp/up-8443 ] && [ -e /tmp/up-8444 ] && [ -e /tmp/up-8445 ] && exit 0; sleep 0.1; done; `+
		`cat /tmp/tls.log; exit 1`)

	t.Run("https port", func(t *testing.T) {
		host := "8443-" + id + "." + domain
		r := d.proxyGet(t, "/", nil, host)
		if r.status != http.StatusOK || string(r.body) != "secret over tls for "+host {
			t.Errorf("GET / on TLS port 8443 by Host: %v, want 200 %q", r, "secret over tls for "+host)
		}
		if sni := mustRun(t, ac, "cat /tmp/sni-8443"); sni != host {
			t.Errorf("server name the sandbox's TLS server got: %q, want the request's host %q", sni, host)
		}
		r = d.proxyGet(t, "/", map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "8443"}, "")
		if r.status != http.StatusOK || !strings.HasPrefix(string(r.body), "secret over tls for ") {
			t.Errorf("GET / on TLS port 8443 by headers: %v, want 200 with the body", r)
		}
	})

	t.Run("websocket", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", d.proxy, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: 8443-%s.%s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
			"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n", id, domain)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("Upgrade through the proxy to TLS port 8443: %v, err %v; want 101", resp, err)
		}
		if _, err := io.WriteString(conn, "ping over tls"); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len("ping over tls"))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != "ping over tls" {
			t.Errorf("echo after the upgrade: %q, err %v", got, err)
		}
	})

	t.Run("mismatch", func(t *testing.T) {
		r := d.proxyGet(t, "/", nil, "8444-"+id+"."+domain)
		checkProxyError(t, r, id, "The sandbox's port closed the connection without an HTTP answer; "+
			"if its server speaks TLS, list the port in network.httpsPorts")
		r = d.proxyGet(t, "/", nil, "8445-"+id+"."+domain)
		checkProxyError(t, r, id, "The sandbox's port is in network.httpsPorts but its server did not speak TLS")
	})

	t.Run("set at create", func(t *testing.T) {
		r := d.expect(t, http.StatusBadRequest, call{method: "PUT", path: "/sandboxes/" + id + "/network", key: d.key,
			invalid: true, body: map[string]any{"httpsPorts": []int{9443}}})
		checkErrorBody(t, "PUT network httpsPorts", r)
		if got := d.get(t, d.key, id).Network.HTTPSPorts; !slices.Equal(got, []int{8443, 8445}) {
			t.Errorf("after a refused update, httpsPorts %v, want [8443 8445]", got)
		}
	})

	t.Run("pause and fork", func(t *testing.T) {
		path := "/sandboxes/" + id
		d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{}})
		if got := d.get(t, d.key, id).Network.HTTPSPorts; !slices.Equal(got, []int{8443, 8445}) {
			t.Errorf("paused: httpsPorts %v, want [8443 8445]", got)
		}
		d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2" + path + "/connect", key: d.key, body: map[string]any{"timeout": 300}})
		host := "8443-" + id + "." + domain
		if r := d.proxyGet(t, "/", nil, host); r.status != http.StatusOK || string(r.body) != "secret over tls for "+host {
			t.Errorf("GET / on TLS port 8443 after a resume: %v", r)
		}
		var forks []types.SandboxForkResult
		d.expect(t, http.StatusCreated, call{method: "POST", path: path + "/fork", key: d.key, body: map[string]any{"count": 1, "timeout": 120}}).decode(t, &forks)
		if len(forks) != 1 || forks[0].Error.Code != 0 {
			t.Fatalf("fork: %+v", forks)
		}
		child := forks[0].Sandbox.SandboxID
		d.remember(child, d.key)
		if got := d.get(t, d.key, child).Network.HTTPSPorts; !slices.Equal(got, []int{8443, 8445}) {
			t.Errorf("a fork's httpsPorts %v, want the source's [8443 8445]", got)
		}
		d.kill(t, d.key, child)
	})

	t.Run("none", func(t *testing.T) {
		plain := d.create(t, d.key, nil)
		if got := d.get(t, d.key, plain.SandboxID).Network; got.HTTPSPorts != nil {
			t.Errorf("a sandbox created without httpsPorts shows %v", got.HTTPSPorts)
		}
	})
}
