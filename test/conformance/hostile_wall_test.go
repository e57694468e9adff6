package conformance

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// Attacks on the wall itself from inside: what a command inherits from
// the agent (descriptors, processes, devices), and root inside turning
// the host's own operations (its dial of the agent) against the host.

// wallBox is a sandbox for these tests: the host template, except on the
// microvm wall (which runs images only), where the test image stands in
// for base.
func wallBox(t *testing.T, w wall, o sandbox.Options) *box {
	if w.name == "microvm" && o.Template == "" {
		importTestImage(t)
		o.Template = testTemplate
	}
	return w.newBox(t, o)
}

// TestHostileInheritedFDs: a command holds only its standard streams (the
// class of runc's CVE-2024-21626: a descriptor of the host's or the
// guest's /dev, /sys or cgroup tree left open into a command is a way out
// of the root). `ls` run directly lists its own descriptors: 0, 1, 2 and
// the directory it reads, nothing else, as user and as root.
func TestHostileInheritedFDs(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := wallBox(t, w, sandbox.Options{})
		for _, user := range []string{"user", "root"} {
			r := b.run(func(o *agentclient.RunOptions) {
				o.Cmd, o.Args, o.User = "/bin/ls", []string{"-l", "/proc/self/fd/"}, user
			})
			if r.err != nil || r.code() != 0 {
				t.Fatalf("ls /proc/self/fd as %s: %v %d %q", user, r.err, r.code(), r.stderr)
			}
			var fds []string
			for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
				f := strings.Fields(line)
				if len(f) < 3 || f[len(f)-2] != "->" {
					continue // "total 0"
				}
				fd, target := f[len(f)-3], f[len(f)-1]
				if fd == "3" && strings.HasSuffix(target, "/fd") {
					continue // ls's own directory
				}
				fds = append(fds, fd+" -> "+target)
			}
			if len(fds) != 3 || !strings.HasPrefix(fds[0], "0 ") || !strings.HasPrefix(fds[1], "1 ") || !strings.HasPrefix(fds[2], "2 ") {
				t.Errorf("as %s a command holds %d descriptors, want 0, 1, 2 only:\n%s", user, len(fds), strings.Join(fds, "\n"))
			}
		}
	})
}

// foreignProcs lists, from inside, every process that is neither PID 1
// (the agent) nor the script's own or its descendants: on a wall that
// gives the sandbox its own PID namespace there is none (a microvm guest
// whose kernel threads and init share the sandbox's namespace shows ~50).
const foreignProcs = `me=$$
for p in /proc/[0-9]*; do
  n=${p#/proc/}
  [ "$n" = 1 ] && continue
  q=$n
  while [ -n "$q" ] && [ "$q" != "$me" ] && [ "$q" != 0 ] && [ "$q" != 1 ]; do
    q=$(sed -n 's/^PPid:[[:space:]]*//p' /proc/$q/status 2>/dev/null)
  done
  [ "$q" = "$me" ] && continue
  [ -e "$p" ] || continue # ended meanwhile
  echo "foreign $n ($(cat $p/comm 2>/dev/null)) ppid $(sed -n 's/^PPid:[[:space:]]*//p' $p/status 2>/dev/null)"
done
echo done`

// TestHostilePIDNamespace: ps and /proc inside show the sandbox's own
// processes only (the agent as PID 1 and what it started), as root too:
// nothing of the host, of a guest kernel's threads or of a guest's init.
func TestHostilePIDNamespace(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := wallBox(t, w, sandbox.Options{})
		out := b.mustSh(foreignProcs, asUser("root"))
		if !strings.HasSuffix(out, "done\n") || strings.Contains(out, "foreign") {
			t.Errorf("processes other than the sandbox's are visible:\n%s", out)
		}
		if got := b.mustSh(`tr '\0' ' ' </proc/1/cmdline`); got != agentArgv(w.name)+" " {
			t.Errorf("PID 1 is %q, want the agent (%s)", got, agentArgv(w.name))
		}
	})
}

// TestHostileDevices: /dev holds the same harmless set on every wall (the
// process wall adds a core link to its masked /proc/kcore): nothing of a
// kernel's other devices, gVisor's FUSE (whose server is attack surface
// no sandbox needs) and TUN included; root cannot open /dev/fuse nor make
// the node again.
func TestHostileDevices(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := wallBox(t, w, sandbox.Options{})
		want := []string{"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"}
		if w.name == "process" || w.name == "microvm" {
			want = append([]string{"core"}, want...)
		}
		if got := strings.Fields(b.mustSh("ls -A /dev", asUser("root"))); !slices.Equal(got, want) {
			t.Errorf("ls /dev: %v, want %v", got, want)
		}
		// (Opened read-only: gVisor's /dev is a tmpfs root may write files
		// in, which are no devices.)
		r := b.sh(`for d in /dev/fuse /dev/net/tun /dev/char/10:229; do
  [ -c $d ] && echo "DEVICE $d"
  (exec 3<$d) 2>/dev/null && echo "OPENED $d"
done
for d in /tmp/fuse /dev/fuse; do
  mknod $d c 10 229 2>/dev/null; [ -c $d ] && echo "MADE $d"
done
exit 0`, asUser("root"))
		if r.err != nil || r.stdout != "" {
			t.Errorf("root reached a FUSE or TUN device: %v %q", r.err, r.stdout)
		}
	})
}

// victim is a unix socket of the host's that a sandbox must never make the
// host dial (a container runtime's API socket stands for it): it counts
// the connections it gets.
type victim struct {
	path string
	mu   sync.Mutex
	got  []string
}

func newVictim(t *testing.T) *victim {
	dir, err := os.MkdirTemp("/run", "cage-victim-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	v := &victim{path: filepath.Join(dir, "api.sock")}
	l, err := net.Listen("unix", v.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(time.Second))
			buf := make([]byte, 4096)
			n, _ := c.Read(buf)
			c.Close()
			v.mu.Lock()
			v.got = append(v.got, string(buf[:n]))
			v.mu.Unlock()
		}
	}()
	return v
}

func (v *victim) connections() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]string(nil), v.got...)
}

// socketsInside lists, as root inside, every unix socket the sandbox can
// see outside /proc, /sys and /dev (under gVisor the agent's socket was
// one), and the old agent socket's path.
const socketsInside = `{ find /run /tmp /var/tmp /home /root /mnt /opt /srv -type s 2>/dev/null; echo /run/cage-sock/agent.sock; } | sort -u`

// TestHostileAgentSocket: root inside turns the host's dial of the agent
// against the host. (1) It replaces every socket it can see, the agent's
// included, with a symlink to a socket of the host's (a container
// runtime's API, here the test's victim): the host's next requests to the
// agent must still reach the agent, and the victim must get no
// connection. (2) It binds a socket of its own in place of each: the
// host's requests, which carry the sandbox's access token, must reach the
// real agent and never the planted socket; nor may root connect to a
// socket of the host's it can see (gVisor's channel socket is the
// agent's alone). Before the agent connected out
// to the host (package channel), gVisor's agent socket sat in a directory
// bound read-write, and both attacks worked.
func TestHostileAgentSocket(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		if w.name == "microvm" {
			t.Skip("SKIP: the microvm's agent is reached over a virtio-serial port: no socket of the host's is inside")
		}
		t.Run("symlink", func(t *testing.T) {
			v := newVictim(t)
			b := w.newBox(t, sandbox.Options{})
			out := b.mustSh(fmt.Sprintf(`for s in $(%s); do
  rm -f "$s" 2>/dev/null; ln -s %s "$s" 2>/dev/null && echo "linked $s"
done; exit 0`, socketsInside, v.path), asUser("root"))
			t.Logf("inside: %q", out)
			fresh := agentclient.New(b.sb.Dial, b.sb.Token())
			defer fresh.Close()
			if got := runWithin(t, fresh, "echo the-agent"); got != "the-agent\n" {
				t.Errorf("after the symlink attack the host's request got %q, want the agent's answer", got)
			}
			if c := v.connections(); len(c) > 0 {
				t.Errorf("the host dialled the victim socket %d times; it received %.80q", len(c), c[0])
			}
		})
		t.Run("impostor", func(t *testing.T) {
			b := w.newBox(t, sandbox.Options{})
			if r := b.sh("command -v python3"); r.code() != 0 {
				t.Skip("SKIP: no python3 inside to bind a socket with")
			}
			script := fmt.Sprintf(`import os, socket, subprocess, threading
paths = subprocess.run(["sh", "-c", %q], capture_output=True, text=True).stdout.split()
log = open("/tmp/impostor.log", "a", buffering=1)
def serve(s, p):
    while True:
        c, _ = s.accept()
        c.settimeout(2)
        try:
            data = c.recv(65536)
        except OSError:
            data = b""
        log.write("GOT %%s %%r\n" %% (p, data[:300]))
        c.close()
for p in paths:
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(p)
        log.write("CONNECTED %%s\n" %% p)
        c.close()
    except OSError as e:
        log.write("no connection to %%s: %%s\n" %% (p, e))
for p in paths:
    try:
        if os.path.lexists(p):
            os.unlink(p)
        s = socket.socket(socket.AF_UNIX)
        s.bind(p)
        s.listen(16)
        log.write("BOUND %%s\n" %% p)
        threading.Thread(target=serve, args=(s, p), daemon=True).start()
    except OSError as e:
        log.write("refused %%s: %%s\n" %% (p, e))
log.write("ready\n")
threading.Event().wait()
`, socketsInside)
			b.mustSh(`cat > /tmp/impostor.py && { setsid python3 /tmp/impostor.py </dev/null >/dev/null 2>&1 & }
for i in $(seq 100); do grep -q ready /tmp/impostor.log 2>/dev/null && break; sleep 0.05; done`, asUser("root"), withStdin(strings.NewReader(script)))
			fresh := agentclient.New(b.sb.Dial, b.sb.Token())
			defer fresh.Close()
			if got := runWithin(t, fresh, "echo the-agent"); got != "the-agent\n" {
				t.Errorf("with a socket of root's in the agent's place the host's request got %q, want the agent's answer", got)
			}
			log := b.mustSh("cat /tmp/impostor.log", asUser("root"))
			if strings.Contains(log, "CONNECTED") {
				t.Errorf("root inside connected to a socket of the host's: %.300q", log)
			}
			if strings.Contains(log, "GOT") || strings.Contains(log, b.sb.Token()) {
				t.Errorf("the host's connection reached the planted socket: %.300q", log)
			} else {
				t.Logf("impostor: %q", log)
			}
		})
	})
}

// runWithin runs script through c, bounded in time: a host dial that
// reaches something other than the agent must fail, not hang.
func runWithin(t *testing.T, c *agentclient.Client, script string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out strings.Builder
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/bash", Args: []string{"-l", "-c", script}, Stdout: &out})
	if err != nil {
		return "error: " + err.Error()
	}
	if end.GetExitCode() != 0 {
		return "exit " + strconv.Itoa(int(end.GetExitCode())) + ": " + out.String()
	}
	return out.String()
}

// TestHostileDiskPath: the host measures a sandbox's disk (its usage in
// the daemon's metrics) on a path root inside cannot redirect. On an image
// root, root may replace /tmp with a symlink to / (the host's root, for a
// host walking into the sandbox's root): the host's measure must still be
// the sandbox's 16 MiB disk, not the host's file system.
func TestHostileDiskPath(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		importTestImage(t)
		b := w.newBox(t, sandbox.Options{Template: testTemplate, Disk: 16 << 20})
		// (gVisor mounts a tmpfs of its own on /tmp, which stays.)
		b.mustSh(`{ rm -rf /tmp && ln -s / /tmp; } 2>/dev/null; exit 0`, asUser("root"))
		p := b.sb.DiskPath()
		if w.name == "microvm" {
			if p != "" {
				t.Errorf("a microvm's disk is inside its guest; DiskPath is %q", p)
			}
			return
		}
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil {
			t.Fatalf("statfs %s: %v", p, err)
		}
		if total := int64(st.Blocks) * st.Bsize; total != 16<<20 {
			t.Errorf("the host measured %s as %d bytes, not the sandbox's 16 MiB disk", p, total)
		}
	})
}
