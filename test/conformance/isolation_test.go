package conformance

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// What a command sees of the machine: its own root, /dev, /proc, accounts,
// host name and cgroup; nothing of the host's other mounts.

func TestIsolationView(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})

		// The top level: what mounts.go creates, plus the host's /bin,
		// /sbin and /lib* that exist here (the "host" template).
		// gVisor adds its own (sentry-made) /sys.
		want := []string{"dev", "etc", "home", "mnt", "opt", "proc", "root", "run", "srv", "tmp", "usr", "var"}
		if w.name == "gvisor" {
			want = append(want, "sys")
		}
		for _, d := range []string{"bin", "sbin", "lib", "lib32", "lib64", "libx32"} {
			if _, err := os.Lstat("/" + d); err == nil {
				want = append(want, d)
			}
		}
		slices.Sort(want)
		if imageRoot(w.name) {
			// The image's own, with an empty /sys (no sysfs is mounted).
			want = baseTopLevel
			if out := b.mustSh("ls -A /sys", asUser("root")); out != "" {
				t.Errorf("/sys is not empty: %q", out)
			}
		}
		if got := strings.Fields(b.mustSh("ls -A /")); !slices.Equal(got, want) {
			t.Errorf("ls /: %v, want %v", got, want)
		}
		// /dev: the process wall's own; runc's default set (no core link);
		// gVisor's kernel makes more (char, fuse, net), which the agent
		// removes: the same set as runc's.
		wantDev := map[string][]string{
			"process": {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"},
			"microvm": {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"},
			"runc":    {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"},
			"gvisor":  {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"},
		}[w.name]
		if got := strings.Fields(b.mustSh("ls -A /dev")); !slices.Equal(got, wantDev) {
			t.Errorf("ls /dev: %v, want %v", got, wantDev)
		}

		if r := b.sh("ls /root"); r.code() == 0 {
			t.Errorf("user can list /root: %q", r.stdout)
		}
		if out := b.mustSh("ls -A /root", asUser("root")); out != "" && !imageRoot(w.name) {
			t.Errorf("/root is not empty: %q", out) // (an image's /root is the image's)
		}
		if out := b.mustSh("grep -c '^user:x:1000:1000:' /etc/passwd; getent passwd 1000 | cut -d: -f1"); out != "1\nuser\n" {
			t.Errorf("/etc/passwd has no user 1000: %q", out)
		}
		if out := b.mustSh("hostname; cat /etc/hostname"); !strings.HasPrefix(out, "cage-") {
			t.Errorf("hostname: %q", out)
		} else if h := strings.Split(out, "\n"); h[0] != h[1] {
			t.Errorf("hostname %q and /etc/hostname %q differ", h[0], h[1])
		}
		if out := b.mustSh("cat /proc/1/cmdline"); out != strings.ReplaceAll(agentArgv(w.name), " ", "\x00")+"\x00" {
			t.Errorf("/proc/1/cmdline: %q", out)
		}
		// Every group is the namespace's root, the sandbox's own; on
		// cgroup v1 a command's pids group is the workload's child of it
		// (cgroups.SplitPids, process and runc walls), seen as /workload.
		for _, line := range strings.Split(strings.TrimSpace(b.mustSh("cat /proc/self/cgroup")), "\n") {
			f := strings.SplitN(line, ":", 3)
			if len(f) == 3 && (f[2] == "/" || (f[1] == "pids" && f[2] == "/workload" && (w.name == "process" || w.name == "runc"))) {
				continue
			}
			t.Errorf("/proc/self/cgroup shows a path other than the sandbox's own (no cgroup namespace?): %q", line)
		}

		// The root is read-only, for root too; the storage is writable.
		// (gVisor's /dev is a writable tmpfs of its own kernel, with no
		// Landlock there to close it; what is written stays in the sandbox.)
		devx := " /dev/x"
		if w.name == "gvisor" {
			devx = ""
		}
		writes := `for p in /newfile /usr/x /etc/x /bin/x /opt/x /var/x /run/x /proc/x` + devx + `; do
  touch $p 2>/dev/null && echo "WROTE $p"
done
mkdir /mnt/x 2>/dev/null && echo "WROTE /mnt/x"
echo > /etc/passwd 2>/dev/null && echo "WROTE /etc/passwd"
exit 0`
		writer := "root"
		if imageRoot(w.name) {
			// The image's root is root's to change; /dev and /proc are not.
			if r := b.sh(`for p in /proc/x /dev/x; do touch $p 2>/dev/null && echo "WROTE $p"; done; exit 0`, asUser("root")); r.err != nil || r.stdout != "" {
				t.Errorf("root wrote /proc or /dev: %v %q", r.err, r.stdout)
			}
			writer = "user"
		}
		r := b.sh(writes, asUser(writer))
		if r.err != nil || strings.Contains(r.stdout, "WROTE") {
			t.Errorf("the read-only root was written by %s: %v %q", writer, r.err, r.stdout)
		}
		b.mustSh(`for d in /tmp /home/user /var/tmp /dev/shm; do echo x > $d/w && rm $d/w || exit 1; done`)

		mounts := b.mustSh("cat /proc/self/mountinfo", asUser("root"))
		for _, line := range strings.Split(strings.TrimSpace(mounts), "\n") {
			// A mount's root within its source filesystem must not name the
			// host's paths (run directory, the sandbox's state, this
			// checkout, root's home); /root is the sandbox's own (on its
			// disk, whose directory for it is "/root" too), so mount points
			// are checked against the list of the sandbox's own instead.
			f := strings.Fields(line)
			if len(f) < 5 {
				t.Errorf("malformed mountinfo line %q", line)
				continue
			}
			root := f[3]
			source := strings.Join(f[6:], " ") // after the optional fields: type, source, options
			for _, bad := range []string{"/run/cage/", "cage-conformance", "/work", "/sandboxes/", "/templates/", "/tmp/cage-bin"} {
				if strings.Contains(root, bad) || strings.Contains(source, bad) {
					t.Errorf("mountinfo shows the host's %q: %q", bad, line)
					break
				}
			}
			if strings.HasPrefix(root, "/root") && f[4] != "/root" {
				t.Errorf("a mount's root is a /root: %q", line)
			}
			if !allowedMountPoint(f[4]) && !(w.name != "process" && f[4] == "/run/cage-agent") &&
				!(w.name == "gvisor" && (f[4] == "/run/cage-sock" || f[4] == "/sys")) {
				t.Errorf("unexpected mount in the sandbox: %q", line)
			}
		}
		wantUsr := "1" // the host template's read-only /usr
		if imageRoot(w.name) {
			wantUsr = "0" // the image's, in its root
		}
		if out := b.mustSh("mount | wc -l; mount | grep -c ' on /usr '; exit 0"); strings.Fields(out)[1] != wantUsr {
			t.Errorf("mount: %q", out)
		}
	})
}

// allowedMountPoint reports whether a sandbox mount point is one the process
// wall makes.
func allowedMountPoint(p string) bool {
	switch p {
	case "/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
		"/etc", "/tmp", "/var/tmp", "/home", "/root", "/dev", "/proc":
		return true
	}
	for _, prefix := range []string{"/usr/", "/etc/", "/dev/", "/proc/", "/lib/", "/lib64/", "/bin/", "/sbin/"} {
		if strings.HasPrefix(p, prefix) {
			return true
		}
	}
	return false
}

// TestFilesThroughWall moves files through the agent's file API (E2B's
// /files and the Filesystem service) and checks them with commands.
func TestFilesThroughWall(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		content := "uploaded through the wall " + randHex(8) + "\n"

		status, body := upload(t, b, "/home/user/a.txt", "", content)
		if status != http.StatusOK {
			t.Fatalf("upload: %d %s", status, body)
		}
		var entries []struct{ Path, Name, Type string }
		if err := json.Unmarshal([]byte(body), &entries); err != nil || len(entries) != 1 || entries[0].Path != "/home/user/a.txt" {
			t.Errorf("upload reply: %s (%v)", body, err)
		}
		if out := b.mustSh("cat /home/user/a.txt; stat -c '%U:%G %a' /home/user/a.txt"); out != content+"user:user 644\n" {
			t.Errorf("the uploaded file seen by a command: %q", out)
		}

		st, err := b.FS.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "/home/user/a.txt"}))
		if err != nil {
			t.Fatalf("stat: %v", err)
		}
		if e := st.Msg.GetEntry(); e.GetType() != fspb.FileType_FILE_TYPE_FILE || e.GetSize() != int64(len(content)) ||
			e.GetOwner() != "user" || e.GetName() != "a.txt" || e.GetPath() != "/home/user/a.txt" {
			t.Errorf("stat: %+v", e)
		}
		ls, err := b.FS.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: "/home/user", Depth: 1}))
		if err != nil {
			t.Fatalf("list: %v", err)
		}
		found := false
		for _, e := range ls.Msg.GetEntries() {
			if e.GetName() == "a.txt" {
				found = true
				if e.GetOwner() != "user" || e.GetGroup() != "user" {
					t.Errorf("listed a.txt owned by %s:%s", e.GetOwner(), e.GetGroup())
				}
			}
		}
		if !found {
			t.Errorf("ListDir /home/user lacks a.txt: %v", ls.Msg.GetEntries())
		}
		if got := download(t, b, "/home/user/a.txt", ""); got != content {
			t.Errorf("download: %q", got)
		}

		// A file a command writes comes back through the API.
		b.mustSh("printf 'from-inside' > /tmp/made-inside")
		if got := download(t, b, "/tmp/made-inside", ""); got != "from-inside" {
			t.Errorf("download of a command's file: %q", got)
		}

		// The API acts as the requested user for ownership: root's upload
		// is root's. (It is not a permission boundary: the caller may name
		// any user.)
		b.mustSh("mkdir -m 700 /tmp/private", asUser("root"))
		if status, body := upload(t, b, "/tmp/private/secret.txt", "root", "root only\n"); status != http.StatusOK {
			t.Errorf("upload as root: %d %s", status, body)
		}
		if out := b.mustSh("stat -c %U:%G /tmp/private/secret.txt", asUser("root")); out != "root:root\n" {
			t.Errorf("root's upload is owned by %q", out)
		}
		if r := b.sh("cat /tmp/private/secret.txt"); r.code() == 0 {
			t.Errorf("user reads root's private file: %q", r.stdout)
		}

		// Writes go only where the sandbox may write, and never to the host.
		marker := "cage-host-escape-" + randHex(6)
		for _, p := range []string{"/usr/" + marker, "/etc/" + marker, "../../../../tmp/" + marker, "/proc/1/root/tmp/x-" + marker} {
			status, _ := upload(t, b, p, "root", "x")
			if imageRoot(w.name) && (strings.HasPrefix(p, "/usr/") || strings.HasPrefix(p, "/etc/")) {
				// The image's root is the sandbox's own copy, root's to
				// write (the file API acts for whoever the caller names):
				// the write lands there, and (below) not on the host.
				if status != http.StatusOK {
					t.Errorf("upload to %s of the image's root: %d", p, status)
				} else if out := b.mustSh("cat "+p, asUser("root")); out != "x" {
					t.Errorf("upload to %s: the sandbox reads %q", p, out)
				}
				continue
			}
			if strings.HasPrefix(p, "../") {
				if status != http.StatusOK {
					t.Errorf("upload to %s (inside /tmp): %d", p, status)
				}
				continue
			}
			if status == http.StatusOK {
				t.Errorf("upload to %s succeeded", p)
			}
		}
		for _, p := range []string{"/usr/" + marker, "/etc/" + marker, "/tmp/" + marker, "/tmp/x-" + marker} {
			if _, err := os.Lstat(p); err == nil {
				os.Remove(p)
				t.Errorf("an upload reached the host's %s", p)
			}
		}
		if out := b.mustSh("cat /tmp/" + marker); out != "x" {
			t.Errorf("../ upload did not land in the sandbox's /tmp: %q", out)
		}
	})
}

func upload(t *testing.T, b *box, path, user, content string) (int, string) {
	t.Helper()
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	resp, err := b.HTTP.Post(agentclient.BaseURL+"/files?"+q.Encode(), "application/octet-stream", strings.NewReader(content))
	if err != nil {
		t.Fatalf("POST /files %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(body)
}

func download(t *testing.T, b *box, path, user string) string {
	t.Helper()
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	resp, err := b.HTTP.Get(agentclient.BaseURL + "/files?" + q.Encode())
	if err != nil {
		t.Fatalf("GET /files %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return ""
	}
	return string(body)
}
