package conformance

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/sandbox"
)

// The file API against the sandbox's own user, on every wall: "user" plants
// symlinks into root's 0700 home and races them, and asks the agent to act
// through them. Every operation acts as the user (the agent's capabilities
// never apply), so each is refused (403 / permission_denied) or acts on the
// user's own files; root's files never change.

// rootState is what root's home holds, as root sees it: names, owners,
// modes and the secret's content.
func rootState(t *testing.T, b *box) string {
	t.Helper()
	return b.mustSh(`cd /root && ls -lnA --time-style=+ . && cat secret`, asUser("root"))
}

// userFS returns a request for the file API as user.
func userReq[T any](msg *T) *connect.Request[T] {
	req := connect.NewRequest(msg)
	req.Header().Set("Authorization", agentclient.UserHeader("user"))
	return req
}

func filesAs(t *testing.T, b *box, method, p, user, body string) (int, string) {
	t.Helper()
	q := url.Values{"path": {p}, "username": {user}}
	req, _ := http.NewRequest(method, agentclient.BaseURL+"/files?"+q.Encode(), strings.NewReader(body))
	if method == "POST" {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := b.HTTP.Do(req)
	if err != nil {
		t.Fatalf("%s /files %s: %v", method, p, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(data)
}

// TestHostileFilePlanting: user links ~/out.txt -> /root/secret (root's
// 0600 file in root's 0700 home) and ~/rootdir -> /root, then asks for
// uploads, downloads, mkdir, move (source and destination), remove, stat,
// list and watch through them: each is refused with 403 or
// permission_denied (an upload to out.txt replaces the link itself, as for
// a dangling link), and /root is as root left it. The old agent replaced
// /root/secret with a file of the user's and listed /root.
func TestHostileFilePlanting(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		b.mustSh(`chmod 700 /root && echo root-secret > /root/secret && chmod 600 /root/secret`, asUser("root"))
		b.mustSh(`cd ~ && ln -s /root/secret out.txt && ln -s /root rootdir && echo mine > mine`, asUser("user"))
		before := rootState(t, b)
		for _, p := range []string{"out.txt", "rootdir/secret", "rootdir/new", "/root/new"} {
			if code, body := filesAs(t, b, "GET", p, "user", ""); code != http.StatusForbidden {
				t.Errorf("download %s as user: %d %s, want 403", p, code, clip(body))
			}
			if p == "out.txt" {
				continue // below
			}
			if code, body := filesAs(t, b, "POST", p, "user", "EVIL"); code != http.StatusForbidden {
				t.Errorf("upload %s as user: %d %s, want 403", p, code, clip(body))
			}
		}
		// A link whose target the user cannot reach is, to the user, a
		// dangling link: the upload replaces the link itself.
		if code, body := filesAs(t, b, "POST", "out.txt", "user", "EVIL"); code != http.StatusOK {
			t.Errorf("upload out.txt as user: %d %s, want 200", code, clip(body))
		}
		if got := b.mustSh(`stat -c '%F %U' ~/out.txt`, asUser("user")); got != "regular file user\n" {
			t.Errorf("after an upload, out.txt is %q, want the user's own regular file", got)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		rpcs := map[string]func() error{
			"MakeDir rootdir/d": func() error {
				_, err := b.FS.MakeDir(ctx, userReq(&fspb.MakeDirRequest{Path: "rootdir/d"}))
				return err
			},
			"Move mine -> rootdir/secret": func() error {
				_, err := b.FS.Move(ctx, userReq(&fspb.MoveRequest{Source: "mine", Destination: "rootdir/secret"}))
				return err
			},
			"Move rootdir/secret -> loot": func() error {
				_, err := b.FS.Move(ctx, userReq(&fspb.MoveRequest{Source: "rootdir/secret", Destination: "loot"}))
				return err
			},
			"Remove rootdir/secret": func() error {
				_, err := b.FS.Remove(ctx, userReq(&fspb.RemoveRequest{Path: "rootdir/secret"}))
				return err
			},
			"Stat rootdir/secret": func() error {
				_, err := b.FS.Stat(ctx, userReq(&fspb.StatRequest{Path: "rootdir/secret"}))
				return err
			},
			"ListDir rootdir": func() error {
				_, err := b.FS.ListDir(ctx, userReq(&fspb.ListDirRequest{Path: "rootdir"}))
				return err
			},
			"CreateWatcher rootdir": func() error {
				_, err := b.FS.CreateWatcher(ctx, userReq(&fspb.CreateWatcherRequest{Path: "rootdir"}))
				return err
			},
		}
		for name, rpc := range rpcs {
			err := rpc()
			if w.name == "gvisor" && name == "Move mine -> rootdir/secret" && connect.CodeOf(err) == connect.CodeInvalidArgument &&
				strings.Contains(err.Error(), "cross-device") {
				continue // gVisor checks mounts first, and /root is a mount of its own there
			}
			if connect.CodeOf(err) != connect.CodePermissionDenied {
				t.Errorf("%s as user: %v, want permission_denied", name, err)
			}
		}
		// What the user may do, the file API does, as the user.
		if code, body := filesAs(t, b, "POST", "made-by-api", "user", "x"); code != http.StatusOK {
			t.Errorf("upload into the user's home: %d %s", code, clip(body))
		}
		if owner := strings.TrimSpace(b.mustSh(`stat -c %U ~/made-by-api`, asUser("user"))); owner != "user" {
			t.Errorf("an upload as user belongs to %q", owner)
		}
		if after := rootState(t, b); after != before {
			t.Errorf("/root changed:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})
}

// TestHostileFileRace: user flips ~/race between a directory of its own and
// a symlink to /root, as fast as it can, while uploads, mkdirs, moves,
// removes and downloads as user go through ~/race. Whichever way each one
// lands, /root never changes and root's secret is never read.
func TestHostileFileRace(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{})
		b.mustSh(`chmod 700 /root && echo root-secret > /root/secret && chmod 600 /root/secret`, asUser("root"))
		b.mustSh(`cd ~ && mkdir racedir && ln -s racedir race && echo mine > mine`, asUser("user"))
		before := rootState(t, b)
		var wg sync.WaitGroup
		wg.Add(1)
		var flipper result
		go func() {
			defer wg.Done()
			flipper = b.sh(`cd ~; n=0; end=$((SECONDS+6)); while [ $SECONDS -lt $end ]; do
  ln -sfn /root race.new && mv -Tf race.new race; ln -sfn racedir race.new && mv -Tf race.new race; n=$((n+1)); done; echo $n`, asUser("user"))
		}()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		written := 0
		for i, deadline := 0, time.Now().Add(5*time.Second); time.Now().Before(deadline); i++ {
			if code, _ := filesAs(t, b, "POST", fmt.Sprintf("race/new%d", i), "user", "EVIL"); code == http.StatusOK {
				written++
			}
			filesAs(t, b, "POST", "race/secret", "user", "EVIL")
			if _, body := filesAs(t, b, "GET", "race/secret", "user", ""); strings.Contains(body, "root-secret") {
				t.Fatal("read root's secret through the race")
			}
			b.FS.MakeDir(ctx, userReq(&fspb.MakeDirRequest{Path: fmt.Sprintf("race/d%d", i)}))
			b.FS.Move(ctx, userReq(&fspb.MoveRequest{Source: "mine", Destination: "race/secret"}))
			b.FS.Move(ctx, userReq(&fspb.MoveRequest{Source: "race/secret", Destination: "mine"}))
			b.FS.Remove(ctx, userReq(&fspb.RemoveRequest{Path: "race/secret"}))
		}
		wg.Wait()
		t.Logf("%d uploads landed in the user's directory while it flipped %s times", written, strings.TrimSpace(flipper.stdout))
		if flipper.code() != 0 {
			t.Errorf("the flipper failed: %v %q", flipper.err, flipper.stderr)
		}
		if after := rootState(t, b); after != before {
			t.Errorf("/root changed:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})
}

// TestBodyBombThroughWall: without the token, a 1 GiB gzip bomb to an RPC
// of each service is answered 401 before its body is read, and the sandbox
// (its agent inside a 128 MiB memory limit) goes on; with the token the
// bomb is refused as resource_exhausted and the sandbox goes on too. The
// old agent inflated the bomb before the 401 and died of it.
func TestBodyBombThroughWall(t *testing.T) {
	var bomb bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&bomb, gzip.BestCompression)
	zero := make([]byte, 1<<20)
	for range 1024 {
		zw.Write(zero)
	}
	zw.Close()
	forEachWall(t, func(t *testing.T, w wall) {
		b := w.newBox(t, sandbox.Options{Memory: 128 << 20})
		for _, c := range []struct {
			token string
			path  string
			want  int
		}{
			{"", "/process.Process/List", http.StatusUnauthorized},
			{"", "/filesystem.Filesystem/Stat", http.StatusUnauthorized},
			{b.sb.Token(), "/process.Process/List", http.StatusTooManyRequests}, // resource_exhausted
			{b.sb.Token(), "/filesystem.Filesystem/ListDir", http.StatusTooManyRequests},
		} {
			conn, err := b.sb.Dial(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			req, _ := http.NewRequest("POST", agentclient.BaseURL+c.path, bytes.NewReader(bomb.Bytes()))
			req.Header.Set("Content-Type", "application/proto")
			req.Header.Set("Content-Encoding", "gzip")
			if c.token != "" {
				req.Header.Set("X-Access-Token", c.token)
			}
			conn.SetDeadline(time.Now().Add(time.Minute))
			// The agent may answer before it has the body, and close: write
			// while reading the answer.
			go req.Write(conn)
			status := 0
			if resp, err := http.ReadResponse(bufio.NewReader(conn), req); err == nil {
				status = resp.StatusCode
				resp.Body.Close()
			}
			conn.Close()
			if status != c.want {
				t.Errorf("bomb to %s (token %v): status %d, want %d", c.path, c.token != "", status, c.want)
			}
			if out := b.mustSh(`echo alive`); out != "alive\n" {
				t.Fatalf("after the bomb to %s: %q", c.path, out)
			}
		}
	})
}
