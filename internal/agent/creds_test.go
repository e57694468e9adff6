package agent

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil"
)

// threadStatus returns fields of /proc/thread-self/status (or of another
// status file): Uid, Gid, Groups, CapEff.
func threadStatus(file string) map[string]string {
	data, _ := os.ReadFile(file)
	out := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && (k == "Uid" || k == "Gid" || k == "Groups" || k == "CapEff") {
			out[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	return out
}

// TestCredsThreadSwitch: a thread acting as a user has the user's
// filesystem ids, no supplementary groups and no effective capability,
// creates files the user owns and cannot read what the user cannot; the
// process's other threads keep the agent's credentials; restore brings
// everything back.
func TestCredsThreadSwitch(t *testing.T) {
	testutil.RequireRoot(t)
	dir, err := os.MkdirTemp("", "cage-creds-") // every user may search /tmp
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o777)
	secret := filepath.Join(dir, "secret")
	os.WriteFile(secret, []byte("x"), 0o600)
	leader := threadStatus("/proc/self/status")
	onThread(func() bool {
		before := threadStatus("/proc/thread-self/status")
		c, err := becomeUser(User{UID: 1000, GID: 1001})
		if err != nil {
			t.Errorf("becomeUser: %v", err)
			return c.restore()
		}
		as := threadStatus("/proc/thread-self/status")
		if !strings.HasSuffix(as["Uid"], " 1000") || !strings.HasSuffix(as["Gid"], " 1001") ||
			as["Groups"] != "" || as["CapEff"] != "0000000000000000" {
			t.Errorf("as the user: %v", as)
		}
		if got := threadStatus("/proc/self/status"); fmt.Sprint(got) != fmt.Sprint(leader) {
			t.Errorf("the main thread changed: %v, was %v", got, leader)
		}
		if err := os.WriteFile(filepath.Join(dir, "made"), nil, 0o644); err != nil {
			t.Errorf("create as the user: %v", err)
		} else if fi, _ := os.Stat(filepath.Join(dir, "made")); fileOwner(fi) != [2]int{1000, 1001} {
			t.Errorf("made by the user, owned by %v", fileOwner(fi))
		}
		if _, err := os.ReadFile(secret); err == nil {
			t.Error("read root's 0600 file as the user")
		}
		ok := c.restore()
		if after := threadStatus("/proc/thread-self/status"); fmt.Sprint(after) != fmt.Sprint(before) {
			t.Errorf("restored: %v, was %v", after, before)
		}
		return ok
	})
	// Root of the sandbox acts without capabilities.
	os.Chown(secret, 1000, 1000)
	onThread(func() bool {
		c, err := becomeUser(User{UID: 0, GID: 0})
		if err == nil {
			if as := threadStatus("/proc/thread-self/status"); as["CapEff"] != "0000000000000000" {
				t.Errorf("as root: %v", as)
			}
			if _, err := os.ReadFile(secret); err == nil {
				t.Error("root without capabilities read another user's 0600 file")
			}
		} else {
			t.Errorf("becomeUser(root): %v", err)
		}
		return c.restore()
	})
	for _, u := range []User{{UID: -1}, {UID: 1 << 32}, {UID: 1, GID: 1<<32 - 1}} {
		onThread(func() bool {
			c, err := becomeUser(u)
			if err == nil {
				t.Errorf("becomeUser(%+v) accepted", u)
			}
			return c.restore()
		})
	}
}

// checkAllThreads fails unless every thread of the process holds the
// credentials the main thread holds: none was left acting as a user.
func checkAllThreads(t *testing.T) {
	t.Helper()
	want := fmt.Sprint(threadStatus("/proc/self/status"))
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, task := range tasks {
		if got := fmt.Sprint(threadStatus("/proc/self/task/" + task.Name() + "/status")); got != want {
			t.Errorf("thread %s holds %s, the process %s", task.Name(), got, want)
		}
	}
}

// hostileHome is a sandbox where "user" planted symlinks into what only
// root may change (/etc) and into another user's 0700 home.
type hostileHome struct {
	*fsEnv
	etcPasswd, otherHome string
}

func newHostileHome(t *testing.T) *hostileHome {
	testutil.RequireRoot(t)
	e := newFSEnv(t)
	h := &hostileHome{fsEnv: e, etcPasswd: filepath.Join(e.root, "etc/passwd"), otherHome: filepath.Join(e.root, "home/other")}
	os.MkdirAll(h.otherHome, 0o700)
	os.WriteFile(filepath.Join(h.otherHome, "secret"), []byte("other's secret"), 0o600)
	for _, p := range []string{h.otherHome, filepath.Join(h.otherHome, "secret")} {
		os.Chown(p, otherUID, otherUID)
	}
	for link, target := range map[string]string{"out.txt": "/etc/passwd", "etc": "/etc", "o": "/home/other"} {
		p := filepath.Join(e.home, link)
		if err := os.Symlink(target, p); err != nil {
			t.Fatal(err)
		}
		os.Lchown(p, e.uid, e.gid)
	}
	e.mustWrite(filepath.Join(e.home, "mine"), "mine")
	t.Cleanup(func() { h.checkUntouched(); checkAllThreads(t) })
	return h
}

// checkUntouched fails if /etc or the other user's home changed.
func (h *hostileHome) checkUntouched() {
	h.t.Helper()
	if got, err := os.ReadFile(h.etcPasswd); err != nil || string(got) != "sandbox passwd\n" {
		h.t.Errorf("/etc/passwd is now %q, %v", got, err)
	}
	if fi, err := os.Lstat(h.etcPasswd); err != nil || fileOwner(fi) != [2]int{0, 0} {
		h.t.Errorf("/etc/passwd changed owner: %v", err)
	}
	for dir, want := range map[string][]string{filepath.Dir(h.etcPasswd): {"passwd"}, h.otherHome: {"secret"}} {
		ents, _ := os.ReadDir(dir)
		var names []string
		for _, en := range ents {
			names = append(names, en.Name())
		}
		if !slices.Equal(names, want) {
			h.t.Errorf("%s now holds %v", dir, names)
		}
	}
	if got, _ := os.ReadFile(filepath.Join(h.otherHome, "secret")); string(got) != "other's secret" {
		h.t.Errorf("the other user's secret is now %q", got)
	}
}

func (h *hostileHome) as(user string, req interface{ Header() http.Header }) {
	req.Header().Set("Authorization", agentclient.UserHeader(user))
}

// TestFilesPlantedLinksActAsUser: "user" links ~/out.txt -> /etc/passwd,
// ~/etc -> /etc and ~/o -> /home/other (0700, another uid). Every file
// operation through them, as user, is refused with 403 / permission_denied
// and changes nothing; root of the sandbox (no capabilities) cannot read
// or write the other user's 0700 home either. The old agent acted with its
// own capabilities: it replaced /etc/passwd with a file of uid 1000, made,
// moved and removed entries in /etc, and listed and read the 0700 home.
func TestFilesPlantedLinksActAsUser(t *testing.T) {
	h := newHostileHome(t)
	ctx := context.Background()
	for _, p := range []string{"out.txt", "etc/passwd", "etc/new", "o/secret", "o/new", "/home/other/new"} {
		if code := h.upload(p, "EVIL"); code != http.StatusForbidden {
			t.Errorf("upload %s as user: %d, want 403", p, code)
		}
	}
	for _, p := range []string{"o/secret", "/home/other/secret"} {
		if code, body := h.download(p); code != http.StatusForbidden {
			t.Errorf("download %s as user: %d %q, want 403", p, code, body)
		}
	}
	for _, user := range []string{"root", "user"} {
		code, body := h.filesReq("GET", url.Values{"path": {"/home/other/secret"}, "username": {user}}, nil, fsTokenHeader)
		if code != http.StatusForbidden {
			t.Errorf("download of the other user's 0600 file as %s: %d %q, want 403", user, code, body)
		}
		code, _ = h.filesReq("POST", url.Values{"path": {"/home/other/new"}, "username": {user}}, strings.NewReader("EVIL"),
			map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"})
		if code != http.StatusForbidden {
			t.Errorf("upload into the other user's 0700 home as %s: %d, want 403", user, code)
		}
	}
	rpcs := map[string]func() error{
		"MakeDir etc/newdir": func() error {
			_, err := h.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: "etc/newdir"}))
			return err
		},
		"Move mine -> etc/passwd": func() error {
			_, err := h.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "mine", Destination: "etc/passwd"}))
			return err
		},
		"Move etc/passwd -> stolen": func() error {
			_, err := h.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "etc/passwd", Destination: "stolen"}))
			return err
		},
		"Move o/secret -> stolen": func() error {
			_, err := h.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "o/secret", Destination: "stolen"}))
			return err
		},
		"Remove etc/passwd": func() error {
			_, err := h.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "etc/passwd"}))
			return err
		},
		"Remove o/secret": func() error {
			_, err := h.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "o/secret"}))
			return err
		},
		"Stat o/secret": func() error { _, err := h.stat("o/secret"); return err },
		"ListDir o":     func() error { _, err := h.list("o", 1); return err },
		"WatchDir o": func() error {
			wctx, cancel := context.WithCancel(ctx)
			defer cancel() // a watch that did start ends here
			_, _, err := h.fsWatch(wctx, "o", false, false)
			return err
		},
		"CreateWatcher /home/other": func() error {
			_, err := h.c().CreateWatcher(ctx, connect.NewRequest(&pb.CreateWatcherRequest{Path: "/home/other"}))
			return err
		},
	}
	for name, rpc := range rpcs {
		if err := rpc(); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("%s as user: %v, want permission_denied", name, err)
		}
	}
	// Listing /home shows the other home, not what is in it.
	es, err := h.list("/home", 3)
	if err != nil || slices.Contains(entryPaths(es), "/home/other/secret") || !slices.Contains(entryPaths(es), "/home/other") {
		t.Errorf("list /home as user: %v, %v", entryPaths(es), err)
	}
	// What the user may do, it does: the links are the user's to remove.
	if _, err := h.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "out.txt"})); err != nil {
		t.Errorf("remove the user's own link: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(h.home, "out.txt")); !os.IsNotExist(err) {
		t.Errorf("the link is still there: %v", err)
	}
	// h.checkUntouched runs at cleanup.
}

// TestFilesRecursiveWatchSeesOnlyTheUsers: a recursive watch of /home as
// user reports what happens in the user's home, never what happens in the
// other user's 0700 home (the old agent watched it with its capabilities).
func TestFilesRecursiveWatchSeesOnlyTheUsers(t *testing.T) {
	h := newHostileHome(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, _, err := h.fsWatch(ctx, "/home", true, true)
	if err != nil {
		t.Fatal(err)
	}
	h.mustWrite(filepath.Join(h.otherHome, "new-secret"), "x")
	os.Mkdir(filepath.Join(h.otherHome, "sub"), 0o755)
	os.WriteFile(filepath.Join(h.otherHome, "sub/deeper"), nil, 0o644)
	os.Remove(filepath.Join(h.otherHome, "new-secret"))
	os.RemoveAll(filepath.Join(h.otherHome, "sub"))
	h.mustWrite(filepath.Join(h.home, "last"), "x")
	for ev := range ch {
		if strings.HasPrefix(ev.GetName(), "other/") {
			t.Fatalf("event from the other user's 0700 home: %v", ev)
		}
		if ev.GetName() == "user/last" {
			return
		}
	}
	t.Fatal("stream ended")
}

// TestFilesAgentUIDRefused: no request acts as the agent's own uid, by
// name or number, through the RPCs or /files (the old /files did).
func TestFilesAgentUIDRefused(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "f"), "x")
	for _, user := range []string{"cage-agent", fmt.Sprint(testAgentUID)} {
		for _, method := range []string{"GET", "POST"} {
			code, _ := e.filesReq(method, url.Values{"path": {"/home/user/f"}, "username": {user}}, strings.NewReader("x"),
				map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"})
			if code != http.StatusBadRequest {
				t.Errorf("%s /files as %s: %d, want 400", method, user, code)
			}
		}
		req := connect.NewRequest(&pb.StatRequest{Path: "/home/user/f"})
		req.Header().Set("Authorization", agentclient.UserHeader(user))
		_, err := e.c().Stat(context.Background(), req)
		wantCode(t, err, connect.CodeInvalidArgument)
	}
}

// TestFilesSymlinkFlipRaceAsUser: while the user flips ~/race between its
// own directory and symlinks to /etc and to the other user's home, uploads,
// mkdirs, moves and removes through ~/race run as user. Nothing the user
// may not write changes, whichever way the race goes (the old agent wrote
// /etc whenever the link was in place).
func TestFilesSymlinkFlipRaceAsUser(t *testing.T) {
	h := newHostileHome(t)
	race := filepath.Join(h.home, "race")
	h.mustWrite(filepath.Join(race, "passwd"), "the user's")
	for _, alt := range []string{"race.etc", "race.other"} {
		target := map[string]string{"race.etc": "/etc", "race.other": "/home/other"}[alt]
		if err := os.Symlink(target, filepath.Join(h.home, alt)); err != nil {
			t.Fatal(err)
		}
		os.Lchown(filepath.Join(h.home, alt), h.uid, h.gid)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			alt := filepath.Join(h.home, []string{"race.etc", "race.other"}[i%2])
			unix.Renameat2(unix.AT_FDCWD, race, unix.AT_FDCWD, alt, unix.RENAME_EXCHANGE)
		}
	}()
	ctx := context.Background()
	for i, deadline := 0, time.Now().Add(2*time.Second); time.Now().Before(deadline); i++ {
		h.upload("race/passwd", "EVIL")
		h.upload(fmt.Sprintf("race/new%d", i), "EVIL")
		h.upload("race/secret", "EVIL")
		h.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: fmt.Sprintf("race/dir%d", i)}))
		h.mustWrite(filepath.Join(h.home, "m"), "EVIL")
		h.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "m", Destination: "race/passwd"}))
		h.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "race/secret", Destination: "loot"}))
		h.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "race/passwd"}))
		h.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "race/secret"}))
		if code, body := h.download("race/secret"); code == 200 && body == "other's secret" {
			t.Fatal("read the other user's secret through the race")
		}
	}
	stop.Store(true)
	wg.Wait()
	// h.checkUntouched and checkAllThreads run at cleanup.
}

// BenchmarkAsUser: what acting as a user adds to one file operation (a
// goroutine on a locked thread, the switch and the restore, checked).
func BenchmarkAsUser(b *testing.B) {
	testutil.RequireRoot(b)
	s := &Server{fileWork: make(chan struct{}, fileWorkers)}
	u := User{UID: 1000, GID: 1000}
	ctx := context.Background()
	for b.Loop() {
		if err := s.asUser(ctx, u, func() error { return nil }); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFSStat: one Stat RPC as user, end to end over loopback HTTP.
func BenchmarkFSStat(b *testing.B) {
	root := b.TempDir()
	os.Chmod(root, 0o755)
	os.MkdirAll(filepath.Join(root, "home/user"), 0o755)
	os.WriteFile(filepath.Join(root, "home/user/f"), []byte("x"), 0o644)
	passwd := filepath.Join(b.TempDir(), "passwd")
	uid := os.Getuid()
	if uid == 0 {
		uid = 1000
	}
	os.WriteFile(passwd, []byte(fmt.Sprintf("user:x:%d:%d::/home/user:/bin/sh\n", uid, uid)), 0o644)
	s, err := New(Config{Root: root, Passwd: passwd, Group: passwd, Token: fsTestToken})
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	defer srv.Close()
	c := filesystemconnect.NewFilesystemClient(&http.Client{Transport: fsTokenTransport{fsTestToken}}, srv.URL)
	ctx := context.Background()
	for b.Loop() {
		if _, err := c.Stat(ctx, connect.NewRequest(&pb.StatRequest{Path: "f"})); err != nil {
			b.Fatal(err)
		}
	}
}
