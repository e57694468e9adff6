package conformance

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/sandbox"
)

// watchScript watches the directories named in its arguments (open,
// access and close events), says so in /tmp/ready, waits for /tmp/stop
// (at most 30 s), then prints how many events came, and from which names.
const watchScript = `
import ctypes, os, select, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
for d in sys.argv[1:]:
    if libc.inotify_add_watch(fd, d.encode(), 0x01 | 0x20 | 0x10) < 0:
        sys.exit("watch %s: errno %d" % (d, ctypes.get_errno()))
open("/tmp/ready", "w").close()
deadline = time.time() + 30
while not os.path.exists("/tmp/stop") and time.time() < deadline:
    time.sleep(0.05)
names = []
while select.select([fd], [], [], 0.2)[0]:
    buf = os.read(fd, 65536)
    off = 0
    while off < len(buf):
        _, mask, _, n = struct.unpack_from("iIII", buf, off)
        names.append(buf[off + 16:off + 16 + n].rstrip(b"\0").decode())
        off += 16 + n
print(len(names), " ".join(sorted(set(names))))
`

// TestInotifySeesOnlyItsOwn: an inotify watch in a sandbox on the
// directories every sandbox of its template shares (/usr/bin, /etc) sees
// the sandbox's own opens, never another sandbox's or the host's (on the
// host template of the process wall and runc these were the host's own
// inodes: a watch on /usr/bin saw which programs the host and the other
// tenants' sandboxes ran, and when; found by review, 2026-12-03). Every
// wall on its default template: runc's and the process wall's the host's
// directories, each sandbox's overlay of its own.
func TestInotifySeesOnlyItsOwn(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		a := w.newBox(t, sandbox.Options{})
		b := w.newBox(t, sandbox.Options{})
		if r := a.sh("command -v python3 && test -e /usr/bin/env && test -e /etc/login.defs"); r.code() != 0 {
			t.Skipf("no python3, /usr/bin/env or /etc/login.defs on %s's default template", w.name)
		}
		a.mustSh("cat > /tmp/watch.py <<'EOF'\n" + watchScript + "EOF")
		watch := func(others func()) string {
			t.Helper()
			a.mustSh("rm -f /tmp/ready /tmp/stop")
			out := make(chan result, 1)
			go func() { out <- a.sh("python3 /tmp/watch.py /usr/bin /etc") }()
			for deadline := time.Now().Add(30 * time.Second); a.sh("test -e /tmp/ready").code() != 0; time.Sleep(50 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the watcher never got ready")
				}
			}
			others()
			a.mustSh("touch /tmp/stop")
			r := <-out
			if r.code() != 0 {
				t.Fatalf("the watcher: %v %q %q", r.err, r.stdout, r.stderr)
			}
			return strings.TrimSpace(r.stdout)
		}
		got := watch(func() {
			b.mustSh("cat /usr/bin/env /etc/login.defs > /dev/null")
			if w.name == "process" || w.name == "runc" { // the host template: the host's /usr and cached /etc
				for _, f := range []string{"/usr/bin/env", "/etc/login.defs"} {
					if _, err := readHostFile(f); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
		// (The sandbox's own commands, which ask for /tmp/ready and
		// /tmp/stop, open bash, id, touch and profile files: env and
		// login.defs are the others' only.)
		if names := strings.Fields(got)[1:]; slices.Contains(names, "env") || slices.Contains(names, "login.defs") {
			t.Errorf("a watch on /usr/bin and /etc saw another sandbox's (and the host's) opens of env and login.defs: %s", got)
		}
		// The watch works: the sandbox's own opens are seen.
		got = watch(func() { a.mustSh("cat /usr/bin/env /etc/login.defs > /dev/null") })
		if !strings.Contains(got, "env") || !strings.Contains(got, "login.defs") {
			t.Errorf("a watch on /usr/bin and /etc missed the sandbox's own opens: %q", got)
		}
	})
}

// readHostFile reads a file as the host does.
func readHostFile(p string) ([]byte, error) { return os.ReadFile(p) }
