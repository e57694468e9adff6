package conformance

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// Rows that try to reach out of the sandbox: the host's files (by path
// tricks, through /proc, by symlinks, through the agent's file API), other
// sandboxes' processes, and the host's network.

func escapeRows(e *hostileEnv) []hostileRow {
	return []hostileRow{
		{
			name:   "host_files_by_path",
			expect: "the host's canaries (/root/…, /home/…) are unreachable: direct, /proc/self/root, /proc/1/root, ../.., /proc/self/cwd/.., symlinks and hard links in /tmp, find by name, grep by content — the secret never appears",
			users:  bothUsers,
			script: canaryScript(e),
			mods: func(e *hostileEnv) []func(*agentclient.RunOptions) {
				return []func(*agentclient.RunOptions){func(o *agentclient.RunOptions) { o.Env = map[string]string{"S": e.secret} }}
			},
			check: noneOf(exitsOK("grep-done"), "cage-canary", "FOUND"),
		},
		{
			name:   "host_files_by_file_api",
			expect: "the file API (Stat, ListDir, GET /files) on /proc/1/root/<canary>, ../../<canary>, symlinks to the canary, as user and as root: never the secret, never a host entry",
			custom: canaryFileAPI,
		},
		{
			name:   "host_shadow",
			expect: "the sandbox's /etc/shadow, /etc/gshadow, /etc/sudoers hold none of the host's password hashes",
			users:  bothUsers,
			custom: hostShadow,
		},
		{
			name:   "shared_etc_tamper",
			expect: "the template's /etc, shared by every sandbox, cannot be changed (write, append, create, remove, rename, chmod all fail) and the witness sandbox's /etc stays the same",
			users:  bothUsers,
			custom: etcTamper,
		},
		{
			name:   "other_sandboxes_processes",
			expect: "in sandbox A, ps and /proc show only A's processes (PID 1 is cage-agent); A cannot see or kill B's processes by B's pid or by their host pid",
			custom: otherSandboxes,
		},
		{
			name:   "network",
			expect: "only lo exists; a TCP server and an abstract unix socket on the host's loopback are unreachable; no route out (ENETUNREACH); a server on the sandbox's own loopback works",
			users:  bothUsers,
			custom: probeNetwork,
		},
	}
}

func canaryScript(e *hostileEnv) string {
	var s strings.Builder
	s.WriteString("cd /home/user 2>/dev/null || cd /tmp\n")
	for i, p := range e.canary {
		fmt.Fprintf(&s, `for q in %[1]s /proc/self/root%[1]s /proc/1/root%[1]s ../../../../../..%[1]s /proc/self/cwd/../../../../..%[1]s /proc/1/cwd/../../..%[1]s; do
  cat "$q" 2>/dev/null
done
ln -sf %[1]s /tmp/canary-sym-%[2]d 2>/dev/null; cat /tmp/canary-sym-%[2]d 2>/dev/null
ln -sf /proc/1/root%[1]s /tmp/canary-sym1-%[2]d 2>/dev/null; cat /tmp/canary-sym1-%[2]d 2>/dev/null
ln %[1]s /tmp/canary-hard-%[2]d 2>/dev/null && cat /tmp/canary-hard-%[2]d
`, p, i)
	}
	// find and grep leave out /usr and /sys, where the host's canaries
	// (in its /root and /home) cannot be: a walk of the host's whole /usr
	// through the template's overlay took over the row's 30 s on a host
	// whose caches had been emptied.
	s.WriteString(`ls -la / /root /home /run /mnt /proc/1/root/ 2>/dev/null
find / \( -path /proc -o -path /usr -o -path /sys \) -prune -o -name 'cage-canary*' -print 2>/dev/null
timeout 10 grep -rlsq -D skip --exclude-dir=proc --exclude-dir=usr --exclude-dir=sys -e "$S" / && echo "FOUND BY GREP"
echo grep-done
`)
	return s.String()
}

func canaryFileAPI(t *testing.T, e *hostileEnv, b *box, _ string) {
	b.mustSh(`ln -sfn /proc/1/root /tmp/api-rootlink`, asUser("root"))
	var paths []string
	for i, p := range e.canary {
		b.mustSh(fmt.Sprintf("ln -sf %[1]s /tmp/api-sym-%[2]d; ln -sf ../../../../..%[1]s /tmp/api-rel-%[2]d", p, i), asUser("root"))
		paths = append(paths, p, "/proc/1/root"+p, "/proc/self/root"+p, "../../"+p, "../../../../../.."+p,
			fmt.Sprintf("/tmp/api-sym-%d", i), fmt.Sprintf("/tmp/api-rel-%d", i), "/tmp/api-rootlink"+p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, user := range bothUsers {
		for _, p := range paths {
			req := connect.NewRequest(&fspb.StatRequest{Path: p})
			req.Header().Set("Authorization", agentclient.UserHeader(user))
			if res, err := b.FS.Stat(ctx, req); err == nil {
				ent := res.Msg.GetEntry()
				if ent.GetType() != fspb.FileType_FILE_TYPE_SYMLINK || strings.Contains(ent.GetSymlinkTarget(), e.secret) {
					t.Errorf("Stat(%q) as %s found a host file: %+v", p, user, ent)
				}
			}
			q := url.Values{"path": {p}, "username": {user}}
			resp, err := b.HTTP.Get(agentclient.BaseURL + "/files?" + q.Encode())
			if err != nil {
				t.Errorf("GET /files %q: %v", p, err)
				continue
			}
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || strings.Contains(string(body), e.secret) {
				t.Errorf("GET /files?path=%s as %s: status %d body %q", p, user, resp.StatusCode, clip(string(body)))
			}
			e.noLeak(t, b, string(body))
		}
		for _, dir := range []string{"/root", "/home", "/proc/1/root/root", "/tmp/api-rootlink/root", "/../../root"} {
			req := connect.NewRequest(&fspb.ListDirRequest{Path: dir, Depth: 2})
			req.Header().Set("Authorization", agentclient.UserHeader(user))
			res, err := b.FS.ListDir(ctx, req)
			if err != nil {
				continue
			}
			for _, ent := range res.Msg.GetEntries() {
				if strings.Contains(ent.GetName(), "cage-canary") || strings.Contains(ent.GetSymlinkTarget(), e.secret) {
					t.Errorf("ListDir(%q) as %s shows the host's %q", dir, user, ent.GetPath())
				}
			}
		}
	}
}

func hostShadow(t *testing.T, e *hostileEnv, b *box, user string) {
	r := b.sh(`cat /etc/shadow /etc/gshadow /etc/sudoers /etc/ssh/ssh_host_*_key 2>/dev/null; exit 0`, asUser(user))
	if r.err != nil {
		t.Fatal(r.err)
	}
	for _, f := range []string{"/etc/shadow", "/etc/gshadow"} {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			fields := strings.Split(line, ":")
			if len(fields) < 2 || len(fields[1]) < 4 { // "", "*", "!", "!*": no hash to leak
				continue
			}
			if strings.Contains(r.stdout, fields[1]) {
				t.Errorf("the sandbox reads the host's %s entry of %s", f, fields[0])
			}
		}
	}
	if key, err := os.ReadFile("/etc/ssh/ssh_host_ed25519_key"); err == nil && len(key) > 0 && strings.Contains(r.stdout, string(key)) {
		t.Errorf("the sandbox reads the host's ssh host key")
	}
}

func otherSandboxes(t *testing.T, e *hostileEnv, a *box, _ string) {
	bb := e.w.newBox(t, sandbox.Options{})
	bpid := strings.TrimSpace(bb.mustSh(`setsid sleep 4747 </dev/null >/dev/null 2>&1 & echo $!`))
	var hostPids []string
	for _, p := range bb.sb.Cgroup().Procs() {
		hostPids = append(hostPids, strconv.Itoa(p))
	}
	out := a.mustSh(`cat /proc/1/cmdline | tr '\0' ' '; echo
for d in /proc/[0-9]*; do printf '%s ' "$(tr '\0' ' ' < $d/cmdline 2>/dev/null)"; done; echo
ps -eo args=`, asUser("root"))
	if !strings.HasPrefix(out, agentArgv(e.w.name)+" \n") {
		t.Errorf("PID 1 in A is not the agent: %q", out)
	}
	if strings.Contains(out, "4747") {
		t.Errorf("A sees B's processes:\n%s", out)
	}
	r := a.sh(fmt.Sprintf(`for p in %s; do kill -9 $p 2>/dev/null && echo "KILLED host pid $p"; done
if [ -r /proc/%s/cmdline ] && tr '\0' ' ' < /proc/%[2]s/cmdline | grep -q 4747; then kill -9 %[2]s && echo "KILLED B's sleep"; fi
exit 0`, strings.Join(hostPids, " "), bpid), asUser("root"))
	if r.err != nil || strings.Contains(r.stdout, "KILLED") {
		t.Errorf("A signalled B's processes: %v %q", r.err, r.stdout)
	}
	if out := bb.mustSh(fmt.Sprintf(`kill -0 %s && tr '\0' ' ' < /proc/%[1]s/cmdline`, bpid)); !strings.Contains(out, "sleep 4747") {
		t.Errorf("B's sleeper is gone or changed: %q", out)
	}
	e.answers(t, bb, "sandbox B")
}

func probeNetwork(t *testing.T, e *hostileEnv, b *box, user string) {
	var accepted atomic.Int32
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	abstract := "@cage-conformance-" + randHex(6)
	uln, err := net.Listen("unix", abstract)
	if err != nil {
		t.Fatal(err)
	}
	defer uln.Close()
	for _, l := range []net.Listener{ln, uln} {
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted.Add(1)
				c.Close()
			}
		}()
	}
	port := ln.Addr().(*net.TCPAddr).Port
	argv := py(fmt.Sprintf(`
print("ifaces=%%s" %% ",".join(n for _, n in socket.if_nameindex()))
def attempt(name, fam, addr):
    try:
        s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(3)
        s.connect(addr); print("%%s=CONNECTED" %% name)
    except OSError as ex:
        print("%%s=%%s" %% (name, errno.errorcode.get(ex.errno, type(ex).__name__)))
attempt("host_tcp", socket.AF_INET, ("127.0.0.1", %d))
attempt("host_abstract", socket.AF_UNIX, "\0%s")
attempt("outside", socket.AF_INET, ("192.0.2.1", 80))
attempt("outside6", socket.AF_INET6, ("2001:db8::1", 80))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname(), timeout=3); conn, _ = srv.accept()
c.sendall(b"ping"); print("own_loopback=%%s" %% conn.recv(4).decode())
`, port, strings.TrimPrefix(abstract, "@")))
	r := b.run(asUser(user), withTimeout(30*time.Second), func(o *agentclient.RunOptions) { o.Cmd, o.Args = argv[0], argv[1:] })
	if r.err != nil {
		t.Fatal(r.err)
	}
	exitsOK("ifaces=lo\n", "host_tcp=ECONNREFUSED", "host_abstract=ECONNREFUSED", "outside=ENETUNREACH", "own_loopback=ping")(t, r)
	if !strings.Contains(r.stdout, "outside6=ENETUNREACH") && !strings.Contains(r.stdout, "outside6=EAFNOSUPPORT") {
		t.Errorf("IPv6 out of the sandbox: want ENETUNREACH (or no IPv6 at all)")
	}
	if strings.Contains(r.stdout, "CONNECTED") || accepted.Load() != 0 {
		t.Errorf("the sandbox reached the host's loopback (%d connections accepted)", accepted.Load())
	}
	if t.Failed() {
		t.Logf("stdout=%q stderr=%q", r.stdout, clip(r.stderr))
	}
}

func etcTamper(t *testing.T, e *hostileEnv, b *box, user string) {
	const sum = "cat /etc/passwd /etc/group /etc/bash.bashrc /etc/profile /etc/ld.so.cache | md5sum; ls -A /etc /etc/profile.d | md5sum"
	before := e.witness.forT(t).mustSh(sum)
	r := b.sh(`echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd 2>/dev/null && echo "WROTE passwd"
echo 'echo evil' >> /etc/bash.bashrc 2>/dev/null && echo "WROTE bashrc"
echo 'echo evil' > /etc/profile.d/evil.sh 2>/dev/null && echo "WROTE profile.d"
: > /etc/ld.so.cache 2>/dev/null && echo "TRUNCATED ld.so.cache"
if test -e /etc/profile; then rm -f /etc/.complete /etc/profile 2>/dev/null; test -e /etc/profile || echo "REMOVED profile"; fi
mv /etc/group /etc/group.old 2>/dev/null && echo "RENAMED group"
chmod 666 /etc/shadow 2>/dev/null && echo "CHMOD shadow"
ln -s /tmp/x /etc/evil-link 2>/dev/null && echo "LINKED"
touch /etc/hosts 2>/dev/null && echo "TOUCHED hosts"
exit 0`, asUser(user))
	if r.err != nil {
		t.Fatal(r.err)
	}
	if imageRoot(e.w.name) && user == "root" {
		// An image's /etc is not shared: it is this sandbox's own copy,
		// which root may change. The witness must not see it.
		if after := e.witness.forT(t).mustSh(sum); after != before {
			t.Errorf("the witness sandbox's /etc changed: %q -> %q", before, after)
		}
		return
	}
	for _, bad := range []string{"WROTE", "TRUNCATED", "REMOVED", "RENAMED", "CHMOD", "LINKED", "TOUCHED"} {
		if strings.Contains(r.stdout, bad) {
			t.Errorf("/etc was changed (%s): %q", bad, r.stdout)
		}
	}
	if after := e.witness.forT(t).mustSh(sum); after != before {
		t.Errorf("the witness sandbox's /etc changed: %q -> %q", before, after)
	}
	// (On an image root, root's run before may have changed this box's own
	// copy; the user's writes are the table above.)
	if out := b.mustSh("grep -c evil /etc/passwd /etc/bash.bashrc; exit 0"); strings.Contains(out, ":1") && !imageRoot(e.w.name) {
		t.Errorf("the probed sandbox's /etc was changed: %q", out)
	}
}
