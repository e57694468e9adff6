package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
)

const (
	otherUID     = 2000  // another sandbox user, "other"
	testAgentUID = 65533 // the agent's own uid, as in a sandbox
	fsTestToken  = "tok"
	fsCanaryData = "canary: must never be read or changed\n"
)

// fsEnv is an agent serving a temporary sandbox root, with a canary file
// outside that root that no request may ever read or change.
type fsEnv struct {
	t        testing.TB
	root     string // sandbox root on the host
	home     string // /home/user inside it
	outside  string // a directory outside the root
	canary   string // outside/canary
	uid, gid int    // the sandbox user "user"
	s        *Server
	srv      *httptest.Server
	inflight atomic.Int64                                  // requests whose handler has not returned
	clients  map[string]filesystemconnect.FilesystemClient // by codec
}

// fsTokenTransport adds the access token to every request.
type fsTokenTransport struct{ token string }

func (tt fsTokenTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-Access-Token", tt.token)
	return http.DefaultTransport.RoundTrip(r)
}

func newFSEnv(t testing.TB) *fsEnv {
	t.Helper()
	e := &fsEnv{t: t, root: t.TempDir(), outside: t.TempDir(), uid: os.Getuid(), gid: os.Getgid()}
	if e.uid == 0 {
		e.uid, e.gid = 1000, 1000 // root in tests: act as another user
	}
	e.home = filepath.Join(e.root, "home/user")
	e.canary = filepath.Join(e.outside, "canary")
	accounts := t.TempDir()
	passwd := filepath.Join(accounts, "passwd")
	group := filepath.Join(accounts, "group")
	e.mustWrite(passwd, fmt.Sprintf("root:x:0:0:root:/root:/bin/bash\nuser:x:%d:%d::/home/user:/bin/bash\n"+
		"other:x:%d:%d::/home/other:/bin/bash\ncage-agent:x:%d:%d::/nonexistent:/usr/sbin/nologin\n",
		e.uid, e.gid, otherUID, otherUID, testAgentUID, testAgentUID))
	e.mustWrite(group, fmt.Sprintf("root:x:0:\nuser:x:%d:\n", e.gid))
	e.mustWrite(e.canary, fsCanaryData)
	// The sandbox root is everyone's to search, as "/" is; the home is
	// the user's, and so is what the tests put there (mustWrite): every
	// file operation acts as the user (creds.go).
	if err := os.Chmod(e.root, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(e.home, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(e.home, e.uid, e.gid); err != nil {
		t.Fatal(err)
	}
	// A sandbox /etc/passwd, to tell it from the host's.
	e.mustWrite(filepath.Join(e.root, "etc/passwd"), "sandbox passwd\n")
	s, err := New(Config{Root: e.root, Passwd: passwd, Group: group, Token: fsTestToken, AgentUID: testAgentUID})
	if err != nil {
		t.Fatal(err)
	}
	e.s = s
	h := e.s.Handler()
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.inflight.Add(1)
		defer e.inflight.Add(-1)
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		e.srv.Close()
		e.s.files.closeWatchers()
		e.checkCanary()
	})
	hc := &http.Client{Transport: fsTokenTransport{fsTestToken}}
	e.clients = map[string]filesystemconnect.FilesystemClient{
		"proto": filesystemconnect.NewFilesystemClient(hc, e.srv.URL),
		"json":  filesystemconnect.NewFilesystemClient(hc, e.srv.URL, connect.WithProtoJSON()),
	}
	return e
}

// mustWrite writes a file, making its parents; below the home, what it
// makes belongs to the user.
func (e *fsEnv) mustWrite(p, data string) {
	e.t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		e.t.Fatal(err)
	}
	if e.home == "" {
		return
	}
	for q := p; strings.HasPrefix(q, e.home+"/"); q = filepath.Dir(q) {
		if err := os.Lchown(q, e.uid, e.gid); err != nil {
			e.t.Fatal(err)
		}
	}
}

func (e *fsEnv) symlink(target, link string) {
	e.t.Helper()
	if err := os.Symlink(target, filepath.Join(e.root, link)); err != nil {
		e.t.Fatal(err)
	}
}

// checkCanary fails the test if anything outside the root changed.
func (e *fsEnv) checkCanary() {
	e.t.Helper()
	got, err := os.ReadFile(e.canary)
	if err != nil || string(got) != fsCanaryData {
		e.t.Errorf("canary changed: %q, %v", got, err)
	}
	ents, err := os.ReadDir(e.outside)
	if err != nil || len(ents) != 1 {
		e.t.Errorf("outside directory changed: %v, %v", ents, err)
	}
}

func (e *fsEnv) c() filesystemconnect.FilesystemClient { return e.clients["proto"] }

func (e *fsEnv) stat(p string) (*pb.EntryInfo, error) {
	res, err := e.c().Stat(context.Background(), connect.NewRequest(&pb.StatRequest{Path: p}))
	if err != nil {
		return nil, err
	}
	return res.Msg.GetEntry(), nil
}

func (e *fsEnv) list(p string, depth uint32) ([]*pb.EntryInfo, error) {
	res, err := e.c().ListDir(context.Background(), connect.NewRequest(&pb.ListDirRequest{Path: p, Depth: depth}))
	if err != nil {
		return nil, err
	}
	return res.Msg.GetEntries(), nil
}

func wantCode(t *testing.T, err error, code connect.Code) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Fatalf("got error %v, want code %v", err, code)
	}
}

func entryPaths(es []*pb.EntryInfo) []string {
	var ps []string
	for _, e := range es {
		ps = append(ps, e.GetPath())
	}
	return ps
}

func TestFSStat(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "a.txt"), "hello")
	os.Chown(filepath.Join(e.home, "a.txt"), e.uid, e.gid)
	e.symlink("a.txt", "home/user/link")
	for codec, c := range e.clients {
		t.Run(codec, func(t *testing.T) {
			res, err := c.Stat(context.Background(), connect.NewRequest(&pb.StatRequest{Path: "a.txt"}))
			if err != nil {
				t.Fatal(err)
			}
			got := res.Msg.GetEntry()
			if got.GetName() != "a.txt" || got.GetPath() != "/home/user/a.txt" || got.GetType() != pb.FileType_FILE_TYPE_FILE ||
				got.GetSize() != 5 || got.GetMode() != 0o644 || got.GetPermissions() != "-rw-r--r--" ||
				got.GetOwner() != "user" || got.GetGroup() != "user" || got.GetModifiedTime().AsTime().IsZero() {
				t.Fatalf("stat a.txt = %v", got)
			}
		})
	}
	for p, want := range map[string]string{"~": "/home/user", "~/a.txt": "/home/user/a.txt", "/": "/", "/home/../home/user/": "/home/user"} {
		if got, err := e.stat(p); err != nil || got.GetPath() != want {
			t.Errorf("stat %q = %v, %v; want path %s", p, got, err, want)
		}
	}
	got, err := e.stat("~/link")
	if err != nil || got.GetType() != pb.FileType_FILE_TYPE_SYMLINK || got.GetSymlinkTarget() != "/home/user/a.txt" {
		t.Fatalf("stat link = %v, %v", got, err)
	}
	if d, err := e.stat("/home"); err != nil || d.GetType() != pb.FileType_FILE_TYPE_DIRECTORY || d.GetPermissions() != "drwxr-xr-x" {
		t.Fatalf("stat /home = %v, %v", d, err)
	}
	_, err = e.stat("missing")
	wantCode(t, err, connect.CodeNotFound)
	_, err = e.stat("")
	wantCode(t, err, connect.CodeInvalidArgument)
	_, err = e.stat("~root/x")
	wantCode(t, err, connect.CodeInvalidArgument)
}

func TestFSListDir(t *testing.T) {
	e := newFSEnv(t)
	for _, f := range []string{"d/a/1.txt", "d/a/b/2.txt", "d/a/b/c/3.txt", "d/z.txt", "other/x.txt"} {
		e.mustWrite(filepath.Join(e.home, f), f)
	}
	e.symlink("/home/user/other", "home/user/d/link") // a symlinked directory: listed, not entered
	cases := map[uint32][]string{
		0: {"a", "link", "z.txt"},
		1: {"a", "link", "z.txt"},
		2: {"a", "a/1.txt", "a/b", "link", "z.txt"},
		9: {"a", "a/1.txt", "a/b", "a/b/2.txt", "a/b/c", "a/b/c/3.txt", "link", "z.txt"},
	}
	for depth, want := range cases {
		for codec, c := range e.clients {
			res, err := c.ListDir(context.Background(), connect.NewRequest(&pb.ListDirRequest{Path: "d", Depth: depth}))
			if err != nil {
				t.Fatalf("%s depth %d: %v", codec, depth, err)
			}
			var got []string
			for _, en := range res.Msg.GetEntries() {
				got = append(got, strings.TrimPrefix(en.GetPath(), "/home/user/d/"))
				if en.GetName() == "link" && (en.GetType() != pb.FileType_FILE_TYPE_SYMLINK || en.GetSymlinkTarget() != "/home/user/other") {
					t.Errorf("link entry = %v", en)
				}
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s depth %d: got %v, want %v", codec, depth, got, want)
			}
		}
	}
	if es, err := e.list("/home/user/d/link", 1); err != nil || len(es) != 1 || es[0].GetPath() != "/home/user/d/link/x.txt" {
		t.Fatalf("listing through a symlink given as the path: %v, %v", entryPaths(es), err)
	}
	_, err := e.list("d/z.txt", 1)
	wantCode(t, err, connect.CodeInvalidArgument)
	_, err = e.list("nope", 1)
	wantCode(t, err, connect.CodeNotFound)
}

func TestFSMakeDirMoveRemove(t *testing.T) {
	e := newFSEnv(t)
	ctx := context.Background()
	for codec, c := range e.clients {
		dir := "made-" + codec + "/x/y"
		res, err := c.MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: dir}))
		if err != nil || res.Msg.GetEntry().GetPath() != "/home/user/"+dir || res.Msg.GetEntry().GetOwner() != "user" {
			t.Fatalf("%s: make dir = %v, %v", codec, res, err)
		}
		for _, p := range []string{"made-" + codec, "made-" + codec + "/x", dir} {
			fi, err := os.Stat(filepath.Join(e.home, p))
			if err != nil || !fi.IsDir() || fileOwner(fi) != [2]int{e.uid, e.gid} {
				t.Fatalf("%s: %s not made or not owned by the user: %v", codec, p, err)
			}
		}
		_, err = c.MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: dir}))
		wantCode(t, err, connect.CodeAlreadyExists)
	}
	e.mustWrite(filepath.Join(e.home, "file"), "x")
	_, err := e.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: "file"}))
	wantCode(t, err, connect.CodeInvalidArgument)

	res, err := e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "file", Destination: "new/parent/moved"}))
	if err != nil || res.Msg.GetEntry().GetPath() != "/home/user/new/parent/moved" || res.Msg.GetEntry().GetSize() != 1 {
		t.Fatalf("move = %v, %v", res, err)
	}
	if _, err := os.Stat(filepath.Join(e.home, "file")); !os.IsNotExist(err) {
		t.Fatalf("source still there: %v", err)
	}
	_, err = e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "file", Destination: "x"}))
	wantCode(t, err, connect.CodeNotFound)
	_, err = e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "/", Destination: "x"}))
	wantCode(t, err, connect.CodeInvalidArgument)

	for _, p := range []string{"new", "made-json"} {
		if _, err := e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: p})); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Lstat(filepath.Join(e.home, p)); !os.IsNotExist(err) {
			t.Fatalf("%s not removed: %v", p, err)
		}
	}
	// What is not there is removed already (E2B's answer too); a path
	// under a file is still an error.
	for _, p := range []string{"new", "never/was"} {
		if _, err := e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: p})); err != nil {
			t.Errorf("remove %q, which does not exist: %v, want success", p, err)
		}
	}
	e.mustWrite(filepath.Join(e.home, "plain"), "x")
	_, err = e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "plain/under"}))
	wantCode(t, err, connect.CodeInvalidArgument)
	_, err = e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "/"}))
	wantCode(t, err, connect.CodeInvalidArgument)
}

func TestFSNeedsToken(t *testing.T) {
	e := newFSEnv(t)
	c := filesystemconnect.NewFilesystemClient(http.DefaultClient, e.srv.URL)
	_, err := c.Stat(context.Background(), connect.NewRequest(&pb.StatRequest{Path: "/"}))
	wantCode(t, err, connect.CodeUnauthenticated)
}

// TestFSHostile tries every way out of the root through the RPCs.
func TestFSHostile(t *testing.T) {
	e := newFSEnv(t)
	ctx := context.Background()
	rel := strings.Repeat("../", 12) + strings.TrimPrefix(e.outside, "/")
	e.symlink("/", "home/user/rootlink")
	e.symlink(e.outside, "home/user/abs")                  // absolute: resolves inside the root
	e.symlink(rel, "home/user/climb")                      // relative, climbing: clamped at the root
	e.symlink("/proc/self/root"+e.outside, "home/user/pr") // magic links, as the sandbox sees them
	e.symlink("/proc/1/root"+e.outside, "home/user/p1")
	e.symlink("/proc/self/cwd", "home/user/cwd")
	e.mustWrite(filepath.Join(e.home, "keep/file"), "x")
	e.symlink(e.outside, "home/user/keep/out")

	if es, err := e.list("../../../../", 1); err != nil || !slices.Equal(entryPaths(es), []string{"/etc", "/home"}) {
		t.Fatalf("listing above the root: %v, %v", entryPaths(es), err)
	}
	if es, err := e.list("rootlink", 1); err != nil || len(es) != 2 {
		t.Fatalf("listing a link to /: %v, %v", entryPaths(es), err)
	}
	if en, err := e.stat("../../etc/passwd"); err != nil || en.GetSize() != int64(len("sandbox passwd\n")) {
		t.Fatalf("stat ../../etc/passwd: %v, %v", en, err)
	}
	for _, p := range []string{"abs", "climb", "pr", "p1", "cwd"} {
		if en, err := e.stat(p + "/canary"); err == nil {
			t.Errorf("stat %s/canary escaped: %v", p, en)
		}
		for _, sub := range []string{"/canary", "/", "/.."} {
			if es, err := e.list(p+sub, 1); err == nil && sub != "/.." {
				t.Errorf("list %s%s escaped: %v", p, sub, entryPaths(es))
			}
		}
		// A missing path removes as success (E2B's answer): what holds
		// is that the canary outside is still there.
		e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: p + "/canary"}))
		if _, err := os.Stat(e.canary); err != nil {
			t.Fatalf("remove %s/canary reached outside the root: %v", p, err)
		}
		if _, err := e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: p + "/canary", Destination: "stolen"})); err == nil {
			t.Errorf("move %s/canary succeeded", p)
		}
		e.mustWrite(filepath.Join(e.home, "m.txt"), "moved")
		e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "m.txt", Destination: p + "/m.txt"}))
		e.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: p + "/newdir"}))
	}
	// Removing a symlink removes the link, never what it points to; removing
	// a tree holding such a link leaves its target alone.
	if _, err := e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "abs"})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "keep"})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(e.home, "abs")); !os.IsNotExist(err) {
		t.Fatal("symlink not removed")
	}
	// e.checkCanary runs at cleanup: outside holds only the untouched canary.
}

// TestFSResolverRefusesMagicLinks resolves in the real "/" to show that
// /proc magic links are refused even where they exist.
func TestFSResolverRefusesMagicLinks(t *testing.T) {
	outside := t.TempDir()
	canary := filepath.Join(outside, "canary")
	if err := os.WriteFile(canary, []byte(fsCanaryData), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(canary)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.Symlink("/proc/self/root"+canary, filepath.Join(outside, "ml")); err != nil {
		t.Fatal(err)
	}
	r, err := openFSRoot("/")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if fd, err := r.open(canary, 0, 0); err != nil {
		t.Fatalf("plain path: %v", err)
	} else {
		closeFD(fd)
	}
	for _, p := range []string{"/proc/self/root" + canary, fmt.Sprintf("/proc/self/fd/%d", f.Fd()),
		"/proc/1/root" + canary, filepath.Join(outside, "ml"), "/proc/self/cwd"} {
		if fd, err := r.open(p, 0, 0); err == nil {
			closeFD(fd)
			t.Errorf("%s: magic link followed", p)
		}
	}
}

func TestFSSandboxPath(t *testing.T) {
	u := User{Name: "user", Home: "/home/user"}
	for in, want := range map[string]string{
		"a": "/home/user/a", "~": "/home/user", "~/": "/home/user", "~/b/../c": "/home/user/c",
		"/x/../../..": "/", "../../../etc": "/etc", "/a//b/": "/a/b", ".": "/home/user",
	} {
		if got, err := sandboxPath(in, u); err != nil || got != want {
			t.Errorf("sandboxPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "~other", "a\x00b"} {
		if _, err := sandboxPath(bad, u); err == nil {
			t.Errorf("sandboxPath(%q) accepted", bad)
		}
	}
	if errnoCode(errors.New("x")) != connect.CodeInternal {
		t.Error("plain errors should be internal")
	}
}

func fileOwner(fi os.FileInfo) [2]int {
	st := fi.Sys().(*syscall.Stat_t)
	return [2]int{int(st.Uid), int(st.Gid)}
}

func closeFD(fd int) { syscall.Close(fd) }

// inotifyFDs counts this process's open inotify instances.
func inotifyFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, en := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + en.Name()); l == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// fsWatch starts WatchDir and returns its filesystem events; the channel
// closes when the stream ends. The first message must be start.
func (e *fsEnv) fsWatch(ctx context.Context, p string, recursive, entry bool) (<-chan *pb.FilesystemEvent, *atomic.Int32, error) {
	req := connect.NewRequest(&pb.WatchDirRequest{Path: p, Recursive: recursive, IncludeEntry: entry})
	req.Header().Set("Keepalive-Ping-Interval", "1")
	stream, err := e.c().WatchDir(ctx, req)
	if err != nil {
		return nil, nil, err
	}
	if !stream.Receive() {
		return nil, nil, stream.Err()
	}
	if stream.Msg().GetStart() == nil {
		return nil, nil, fmt.Errorf("first message %v is not start", stream.Msg())
	}
	ch := make(chan *pb.FilesystemEvent, 4096)
	keepalives := &atomic.Int32{}
	go func() {
		defer close(ch)
		defer stream.Close()
		for stream.Receive() {
			if ev := stream.Msg().GetFilesystem(); ev != nil {
				ch <- ev
			} else if stream.Msg().GetKeepalive() != nil {
				keepalives.Add(1)
			}
		}
	}()
	return ch, keepalives, nil
}

// waitEvent waits for an event named name of type typ, failing on any event
// about an upload's temporary file.
func waitEvent(t *testing.T, ch <-chan *pb.FilesystemEvent, name string, typ pb.EventType) *pb.FilesystemEvent {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatalf("stream ended waiting for %v %s", typ, name)
			}
			if strings.Contains(ev.GetName(), uploadTempPrefix) {
				t.Fatalf("temporary upload file reported: %v", ev)
			}
			if ev.GetName() == name && ev.GetType() == typ {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %v event for %s", typ, name)
		}
	}
}

func TestFSWatchDir(t *testing.T) {
	e := newFSEnv(t)
	dir := filepath.Join(e.home, "w")
	e.mustWrite(filepath.Join(dir, "old"), "x")
	before := inotifyFDs()
	ctx, cancel := context.WithCancel(context.Background())
	ch, keepalives, err := e.fsWatch(ctx, "w", false, false)
	if err != nil {
		t.Fatal(err)
	}
	e.mustWrite(filepath.Join(dir, "a"), "1")
	waitEvent(t, ch, "a", pb.EventType_EVENT_TYPE_CREATE)
	waitEvent(t, ch, "a", pb.EventType_EVENT_TYPE_WRITE)
	os.Chmod(filepath.Join(dir, "a"), 0o600)
	waitEvent(t, ch, "a", pb.EventType_EVENT_TYPE_CHMOD)
	os.Rename(filepath.Join(dir, "a"), filepath.Join(dir, "b"))
	waitEvent(t, ch, "a", pb.EventType_EVENT_TYPE_RENAME)
	waitEvent(t, ch, "b", pb.EventType_EVENT_TYPE_CREATE)
	os.Remove(filepath.Join(dir, "b"))
	waitEvent(t, ch, "b", pb.EventType_EVENT_TYPE_REMOVE)
	// An upload shows up under its own name, not as its temporary file.
	if code := e.upload("/home/user/w/old", "new content"); code != http.StatusOK {
		t.Fatalf("upload: %d", code)
	}
	waitEvent(t, ch, "old", pb.EventType_EVENT_TYPE_WRITE)
	for deadline := time.Now().Add(5 * time.Second); keepalives.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if keepalives.Load() == 0 {
		t.Error("no keepalive within the requested interval")
	}
	cancel()
	for range ch {
	}
	deadline := time.Now().Add(5 * time.Second)
	for inotifyFDs() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := inotifyFDs(); n > before {
		t.Fatalf("inotify descriptors: %d before, %d after the client left", before, n)
	}
	_, _, err = e.fsWatch(context.Background(), "w/missing", false, false)
	wantCode(t, err, connect.CodeNotFound)
	_, _, err = e.fsWatch(context.Background(), "w/old", false, false)
	wantCode(t, err, connect.CodeInvalidArgument)
}

func TestFSWatchRecursive(t *testing.T) {
	e := newFSEnv(t)
	dir := filepath.Join(e.home, "r")
	e.mustWrite(filepath.Join(dir, "pre/x"), "x")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, _, err := e.fsWatch(ctx, "~/r", true, true)
	if err != nil {
		t.Fatal(err)
	}
	e.mustWrite(filepath.Join(dir, "pre/x"), "changed")
	waitEvent(t, ch, "pre/x", pb.EventType_EVENT_TYPE_WRITE)
	if _, err := e.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: "r/sub/deeper"})); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, ch, "sub", pb.EventType_EVENT_TYPE_CREATE)
	e.mustWrite(filepath.Join(dir, "sub/deeper/f"), "in a new directory")
	ev := waitEvent(t, ch, "sub/deeper/f", pb.EventType_EVENT_TYPE_WRITE)
	if ev.GetEntry().GetPath() != "/home/user/r/sub/deeper/f" || ev.GetEntry().GetType() != pb.FileType_FILE_TYPE_FILE {
		t.Fatalf("event entry = %v", ev.GetEntry())
	}
	// A symlink to a directory outside is not followed by a recursive watch.
	e.symlink(e.outside, "home/user/r/out")
	waitEvent(t, ch, "out", pb.EventType_EVENT_TYPE_CREATE)
	os.WriteFile(filepath.Join(e.outside, "ignored"), nil, 0o644)
	os.Remove(filepath.Join(e.outside, "ignored"))
	e.mustWrite(filepath.Join(dir, "last"), "x")
	for ev := range ch {
		if strings.HasPrefix(ev.GetName(), "out/") {
			t.Fatalf("event from outside the tree: %v", ev)
		}
		if ev.GetName() == "last" {
			return
		}
	}
	t.Fatal("stream ended")
}

func TestFSPollingWatcher(t *testing.T) {
	e := newFSEnv(t)
	ctx := context.Background()
	os.Mkdir(filepath.Join(e.home, "p"), 0o755)
	res, err := e.c().CreateWatcher(ctx, connect.NewRequest(&pb.CreateWatcherRequest{Path: "p"}))
	if err != nil {
		t.Fatal(err)
	}
	id := res.Msg.GetWatcherId()
	e.mustWrite(filepath.Join(e.home, "p/f"), "x")
	var got []string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && !slices.Contains(got, "1 f"); {
		evs, err := e.clients["json"].GetWatcherEvents(ctx, connect.NewRequest(&pb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs.Msg.GetEvents() {
			got = append(got, fmt.Sprintf("%d %s", ev.GetType(), ev.GetName()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !slices.Contains(got, "1 f") {
		t.Fatalf("events %v lack the create", got)
	}
	if _, err := e.c().RemoveWatcher(ctx, connect.NewRequest(&pb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	_, err = e.c().GetWatcherEvents(ctx, connect.NewRequest(&pb.GetWatcherEventsRequest{WatcherId: id}))
	wantCode(t, err, connect.CodeNotFound)
	_, err = e.c().CreateWatcher(ctx, connect.NewRequest(&pb.CreateWatcherRequest{Path: "nope"}))
	wantCode(t, err, connect.CodeNotFound)

	// The buffer is bounded: the oldest events go.
	pw := &pollWatcher{}
	for i := range maxWatcherEvents + 5 {
		pw.push(&pb.FilesystemEvent{Name: fmt.Sprint(i)})
	}
	evs := pw.take()
	if len(evs) != maxWatcherEvents || evs[0].GetName() != "5" || len(pw.take()) != 0 {
		t.Fatalf("buffer kept %d events from %s", len(evs), evs[0].GetName())
	}
}
