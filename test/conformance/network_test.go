package conformance

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// Network: what a sandbox may reach in each mode, enforced on the host. The
// test process runs in a network namespace of its own (see TestMain); the
// "outside" is testutil's world: public hosts, an upstream resolver, a
// foreign resolver, and cloud metadata services. No packet leaves the
// machine.

// netProbe is a python program run inside a sandbox: it tries each case and
// prints a JSON object of case -> outcome ("OK:<body>", "A:<address>",
// "NX", or the error's name).
const netProbe = `
import socket, errno, json, sys
out = {}
def err(ex):
    if isinstance(ex, socket.timeout): return "TIMEOUT"
    if isinstance(ex, socket.gaierror): return "NX"
    return errno.errorcode.get(ex.errno, type(ex).__name__) if getattr(ex, "errno", None) else type(ex).__name__
def get(name, host, port, fam=socket.AF_INET):
    try:
        s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(4)
        s.connect((host, port)); s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        data = b""
        while True:
            d = s.recv(4096)
            if not d: break
            data += d
        out[name] = "OK:" + data.split(b"\r\n\r\n", 1)[-1].decode()
    except Exception as ex:
        out[name] = err(ex)
def resolve(name, host):
    try: out[name] = "A:" + socket.gethostbyname(host)
    except Exception as ex: out[name] = err(ex)
def dns_udp(name, server, qname):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(bytes([len(l)]) + l.encode() for l in qname.split(".")) + b"\x00\x00\x01\x00\x01"
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        s.sendto(q, (server, 53)); s.recv(512); out[name] = "ANSWERED"
    except Exception as ex:
        out[name] = err(ex)
CASES
print(json.dumps(out))
`

func (b *box) probeNet(t *testing.T, cases string) map[string]string {
	t.Helper()
	r := b.pyRunRaw(strings.Replace(netProbe, "CASES", cases, 1), withTimeout(90*time.Second))
	if r.err != nil || r.code() != 0 {
		t.Fatalf("network probe: %v code=%d stderr=%q", r.err, r.code(), clip(r.stderr))
	}
	out := map[string]string{}
	if err := json.Unmarshal([]byte(strings.TrimSpace(r.stdout)), &out); err != nil {
		t.Fatalf("network probe output %q: %v", r.stdout, err)
	}
	t.Logf("probe: %v", out)
	return out
}

// pyRunRaw runs a python program as is.
func (b *box) pyRunRaw(code string, mods ...func(*agentclient.RunOptions)) result {
	return b.run(append([]func(*agentclient.RunOptions){func(o *agentclient.RunOptions) {
		o.Cmd, o.Args = "/usr/bin/python3", []string{"-c", code}
	}}, mods...)...)
}

// netHost is the process host, its network pointed at the world's resolver.
func netHost(t testing.TB) (*sandbox.Host, *testutil.World) {
	h := processHost(t)
	w := testutil.SharedWorld(t)
	if h.Network() == nil {
		h.NetConfig.Upstreams = w.Upstreams()
	}
	return h, w
}

func policy(t *testing.T, mode network.Mode, allow ...string) network.Policy {
	t.Helper()
	p := network.Policy{Mode: mode}
	for _, a := range allow {
		r, err := network.ParseRule(a)
		if err != nil {
			t.Fatal(err)
		}
		p.Allow = append(p.Allow, r)
	}
	return p
}

func expectOutcomes(t *testing.T, got map[string]string, want map[string]func(string) bool, says map[string]string) {
	t.Helper()
	for name, ok := range want {
		if v, found := got[name]; !found || !ok(v) {
			t.Errorf("%s: got %q; expected: %s", name, v, says[name])
		}
	}
}

func is(s string) func(string) bool { return func(v string) bool { return v == s } }
func refused() func(string) bool    { return func(v string) bool { return !strings.HasPrefix(v, "OK:") } }
func notResolved() func(string) bool {
	return func(v string) bool { return !strings.HasPrefix(v, "A:") }
}
func hasPrefix(p string) func(string) bool {
	return func(v string) bool { return strings.HasPrefix(v, p) }
}

func TestNetworkInternet(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		h, world := netHost(t)
		b := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Internet}})
		other := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Internet}})
		otherIP := other.sb.Network().IP
		other.sh("nohup python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 &")
		gw := h.Network().Gateway()
		foreignBefore := len(world.ForeignAsked())
		cases := fmt.Sprintf(`
get("public_ip", "%[1]s", 80)
get("public_name", "other.example.org", 80)
resolve("resolve", "www.example.com")
resolve("metadata_name", "metadata.google.internal")
get("metadata", "169.254.169.254", 80)
get("metadata_decimal", "2852039166", 80)
get("metadata_hex", "0xa9fea9fe", 80)
get("metadata_octal", "0251.0376.0251.0376", 80)
get("metadata_mapped", "::ffff:169.254.169.254", 80, socket.AF_INET6)
get("metadata_fd00_ec2", "fd00:ec2::254", 80, socket.AF_INET6)
get("metadata_alibaba", "100.100.100.200", 80)
get("metadata_azure", "168.63.129.16", 80)
get("host_uplink", "%[2]s", %[3]d)
get("host_via_gateway", "%[4]s", %[5]d)
get("other_sandbox", "%[6]s", 8000)
dns_udp("foreign_dns", "%[7]s", "www.example.com")
get("foreign_dns_tcp", "%[7]s", 53)
get("dns_over_tls", "%[7]s", 853)
`, testutil.PublicHost, world.HostHTTP.Addr(), world.HostHTTP.Port(), gw, world.HostLo.Port(), otherIP, testutil.ForeignDNS)
		got := b.probeNet(t, cases)
		says := map[string]string{
			"public_ip": "a public host answers", "public_name": "a public name resolves and answers",
			"resolve": "names resolve through the host's resolver", "metadata_name": "metadata.google.internal never resolves",
			"host_uplink": "the host's own services are refused", "host_via_gateway": "the host is refused through the gateway too",
			"other_sandbox": "another sandbox is refused", "foreign_dns": "DNS to another resolver gets no answer",
			"foreign_dns_tcp": "DNS over TCP to another resolver is refused", "dns_over_tls": "DNS over TLS is refused",
		}
		want := map[string]func(string) bool{
			"public_ip": is("OK:public " + testutil.PublicHost.String()), "public_name": is("OK:other " + testutil.OtherHost.String()),
			"resolve": is("A:" + testutil.PublicHost.String()), "metadata_name": notResolved(),
			"host_uplink": refused(), "host_via_gateway": refused(), "other_sandbox": refused(),
			"foreign_dns": func(v string) bool { return v != "ANSWERED" }, "foreign_dns_tcp": refused(), "dns_over_tls": refused(),
		}
		for _, m := range []string{"metadata", "metadata_decimal", "metadata_hex", "metadata_octal", "metadata_mapped", "metadata_fd00_ec2", "metadata_alibaba", "metadata_azure"} {
			want[m], says[m] = refused(), "cloud metadata is refused in every spelling"
		}
		expectOutcomes(t, got, want, says)
		if n := len(world.ForeignAsked()); n != foreignBefore {
			t.Errorf("the foreign resolver was asked %v", world.ForeignAsked()[foreignBefore:])
		}
		// The other sandbox's server does run: it is the wall that refused.
		if r := other.sh("python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8000/\", timeout=5).status)'"); !strings.Contains(r.stdout, "200") {
			t.Logf("(the other sandbox's own server did not answer itself: %q %q)", r.stdout, clip(r.stderr))
		}
	})
}

func TestNetworkAllowlist(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		_, world := netHost(t)
		b := w.newBox(t, sandbox.Options{Net: policy(t, network.Allowlist, "allowed.example.com:80", testutil.OtherHost.String()+"/32:80")})
		tunnel := make([]string, 12)
		var tunnelCases strings.Builder
		for i := range tunnel {
			tunnel[i] = randHex(24) + ".exfil.example.org"
			fmt.Fprintf(&tunnelCases, "resolve(\"tunnel%d\", %q)\n", i, tunnel[i])
		}
		got := b.probeNet(t, fmt.Sprintf(`
get("before_lookup", "%[1]s", 80)
resolve("allowed", "allowed.example.com")
get("allowed_name", "allowed.example.com", 80)
get("allowed_other_port", "allowed.example.com", 8080)
get("allowed_cidr", "%[2]s", 80)
resolve("not_listed", "other.example.org")
get("ip_literal_of_unlisted", "%[1]s", 8080)
get("metadata", "169.254.169.254", 80)
%[3]s`, testutil.PublicHost, testutil.OtherHost, tunnelCases.String()))
		want := map[string]func(string) bool{
			"before_lookup":          refused(),
			"allowed":                is("A:" + testutil.PublicHost.String()),
			"allowed_name":           hasPrefix("OK:public"),
			"allowed_other_port":     refused(),
			"allowed_cidr":           hasPrefix("OK:other"),
			"not_listed":             notResolved(),
			"ip_literal_of_unlisted": refused(),
			"metadata":               refused(),
		}
		says := map[string]string{
			"before_lookup": "an allowed name's address is closed until the sandbox resolves the name",
			"allowed":       "an allowed name resolves", "allowed_name": "and answers on its allowed port",
			"allowed_other_port": "but not on another port", "allowed_cidr": "an allowed address range answers",
			"not_listed": "a name not listed does not resolve", "ip_literal_of_unlisted": "an address nobody allowed is refused",
			"metadata": "metadata is refused",
		}
		for i := range tunnel {
			n := fmt.Sprintf("tunnel%d", i)
			want[n], says[n] = notResolved(), "long random names under an unlisted domain (DNS tunnelling) do not resolve"
		}
		expectOutcomes(t, got, want, says)
		for _, asked := range world.UpstreamAsked() {
			if slices.Contains(tunnel, asked) {
				t.Errorf("the upstream resolver was asked %q: DNS carried data out", asked)
			}
		}

		// A policy change on the running sandbox: internet, then nothing.
		net := b.sb.Network()
		if err := net.SetPolicy(network.Policy{Mode: network.Internet}); err != nil {
			t.Fatal(err)
		}
		got = b.probeNet(t, `get("after_internet", "other.example.org", 80)`)
		expectOutcomes(t, got, map[string]func(string) bool{"after_internet": hasPrefix("OK:other")},
			map[string]string{"after_internet": "after the change to internet, any public name answers"})
		if err := net.SetPolicy(network.Policy{Mode: network.None}); err != nil {
			t.Fatal(err)
		}
		got = b.probeNet(t, fmt.Sprintf(`get("after_none", "%s", 80)
resolve("resolve_after_none", "www.example.com")`, testutil.PublicHost))
		expectOutcomes(t, got, map[string]func(string) bool{"after_none": refused(), "resolve_after_none": notResolved()},
			map[string]string{"after_none": "after the change to none, nothing answers", "resolve_after_none": "and nothing resolves"})
	})
}

// TestNetworkSelfDefence: root inside a networked sandbox cannot rewrite
// its own interface, address or routes, nor forge packets: the interface is
// configured from the host, and the host's rules would drop a forged source
// anyway.
func TestNetworkSelfDefence(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		netHost(t)
		b := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Allowlist}})
		r := b.pyRunRaw(`
import socket, fcntl, struct, errno
def attempt(name, fn):
    try:
        fn(); print(name + "=DONE")
    except OSError as ex:
        print(name + "=" + errno.errorcode.get(ex.errno, str(ex.errno)))
attempt("raw_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW))
attempt("packet_socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
def set_addr():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    req = struct.pack("16sH2s4s8s", b"eth0", socket.AF_INET, b"\0\0", socket.inet_aton("10.209.0.9"), b"\0" * 8)
    fcntl.ioctl(s, 0x8916, req)  # SIOCSIFADDR
attempt("set_address", set_addr)
def link_down():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"eth0", 0, b"\0" * 14))  # SIOCSIFFLAGS: down
attempt("link_down", link_down)
def ipv6_neighbour():
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.sendto(b"x", ("fe80::1234", 9, 0, socket.if_nametoindex("eth0")))
attempt("ipv6_neighbour", ipv6_neighbour)
`, asUser("root"), withTimeout(30*time.Second))
		if r.err != nil || r.code() != 0 {
			t.Fatalf("probe: %v code %d stderr %q", r.err, r.code(), clip(r.stderr))
		}
		t.Logf("probe: %q", r.stdout)
		// No IPv6 on eth0 (found by review, 2026-12-03: its link-local
		// address let a sandbox fill the host's IPv6 neighbour table, one
		// for every namespace, with sends to fe80::N%eth0). gVisor and the
		// microvm have stacks of their own.
		if w.name == "process" || w.name == "runc" {
			if !strings.Contains(r.stdout, "ipv6_neighbour=") || strings.Contains(r.stdout, "ipv6_neighbour=DONE") {
				t.Errorf("a send to a link-local IPv6 neighbour on eth0: %q; want refused (no IPv6 on eth0)", r.stdout)
			}
			if out := b.mustSh("cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 2>/dev/null || echo none"); strings.TrimSpace(out) != "1" && strings.TrimSpace(out) != "none" {
				t.Errorf("eth0's disable_ipv6: %q, want 1", out)
			}
		}
		for _, name := range []string{"raw_socket", "packet_socket", "set_address", "link_down"} {
			if strings.Contains(r.stdout, name+"=DONE") {
				t.Errorf("root in the sandbox could %s (expected: refused, the interface is the host's to configure)", name)
			}
		}
	})
}

// TestNetworkTeardown: destroying a networked sandbox leaves no interface
// and no rules behind.
func TestNetworkTeardown(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		h, _ := netHost(t)
		b := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Internet}})
		slot := b.sb.Network().Slot
		if err := b.sb.Destroy(); err != nil {
			t.Fatal(err)
		}
		if links := network.HostLinks(); slices.Contains(links, slot) {
			t.Errorf("interface cage%d left after destroy", slot)
		}
		if slots, err := h.Network().RuleSlots(); err != nil || slices.Contains(slots, slot) {
			t.Errorf("rules of slot %d left after destroy (%v)", slot, err)
		}
	})
}
