package daemontest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/apispec"
	"github.com/cagehq/cage/internal/testutil"
)

// content is one request to a volume's content API with a bearer token
// ("" sends none); the request and response are checked against the
// document, and an error must be E2B's {code: word, message}.
func (d *daemon) content(t *testing.T, method, volID, token, op string, q url.Values, body []byte) reply {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, d.apiURL()+"/volumecontent/"+volID+"/"+op+"?"+q.Encode(), rd)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if body != nil {
		ct := "application/octet-stream"
		if method == http.MethodPatch {
			ct = "application/json"
		}
		req.Header.Set("Content-Type", ct)
	}
	resp, err := d.http.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	r := reply{status: resp.StatusCode, header: resp.Header, body: data}
	if err := apispec.ValidateResponse(req, r.status, r.header, data); err != nil {
		t.Errorf("%s %s: %v", method, req.URL.Path, err)
	}
	noStack(t, method+" "+req.URL.Path, string(data))
	if r.status >= 400 {
		var e types.VolumeContentError
		if json.Unmarshal(data, &e) != nil || e.Code == "" || e.Message == "" {
			t.Errorf("%s %s: error %d body %q is not {code, message}", method, req.URL.Path, r.status, data)
		}
	}
	return r
}

func (d *daemon) createVolume(t *testing.T, key, name string) types.VolumeAndToken {
	t.Helper()
	r := d.expect(t, http.StatusCreated, call{method: "POST", path: "/volumes", key: key, body: map[string]any{"name": name}})
	var v types.VolumeAndToken
	r.decode(t, &v)
	if v.VolumeID == "" || v.Name != name || v.Token == "" {
		t.Fatalf("POST /volumes %q: %s", name, r.body)
	}
	return v
}

func q(kv ...string) url.Values {
	v := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		v.Set(kv[i], kv[i+1])
	}
	return v
}

// TestVolumes: the control routes with their bad names and keys, the
// content API with its tokens, and a volume mounted in two sandboxes one
// after the other.
func TestVolumes(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	key, other := d.key, d.createKey(t, "other")

	v := d.createVolume(t, key, "data_1-A")
	for _, bad := range []string{"", "a b", "x/y", "..", "é", "semi;colon", strings.Repeat("n", 129)} {
		d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/volumes", key: key, body: map[string]any{"name": bad}})
	}
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/volumes", key: key, body: map[string]any{"name": "data_1-A"}})
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/volumes", key: key, body: []byte("{"), invalid: true})
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/volumes"})
	// Another key: its own namespace of names, and none of this key's volumes.
	ov := d.createVolume(t, other, "data_1-A")
	var mine, theirs []types.Volume
	d.expect(t, http.StatusOK, call{method: "GET", path: "/volumes", key: key}).decode(t, &mine)
	d.expect(t, http.StatusOK, call{method: "GET", path: "/volumes", key: other}).decode(t, &theirs)
	if len(mine) != 1 || mine[0].VolumeID != v.VolumeID || len(theirs) != 1 || theirs[0].VolumeID != ov.VolumeID {
		t.Errorf("GET /volumes: key 1 sees %+v, key 2 sees %+v; want each its own one", mine, theirs)
	}
	var got types.VolumeAndToken
	d.expect(t, http.StatusOK, call{method: "GET", path: "/volumes/" + v.VolumeID, key: key}).decode(t, &got)
	if got != v {
		t.Errorf("GET /volumes/%s: %+v, want %+v", v.VolumeID, got, v)
	}
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/volumes/" + v.VolumeID, key: other})
	d.expect(t, http.StatusNotFound, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: other})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/volumes/nosuchvolume", key: key})

	// Tokens: none, a wrong one, another volume's, a key: 401.
	for _, tok := range []string{"", "nope", ov.Token, key} {
		if r := d.content(t, "GET", v.VolumeID, tok, "path", q("path", "/"), nil); r.status != http.StatusUnauthorized {
			t.Errorf("GET /volumecontent/%s/path with token %.8q: %v, want 401", v.VolumeID, tok, r)
		}
	}
	if r := d.content(t, "GET", "nosuchvolume", v.Token, "path", q("path", "/"), nil); r.status != http.StatusUnauthorized {
		t.Errorf("a token on an unknown volume: %v, want 401", r)
	}

	// The content API.
	r := d.content(t, "PUT", v.VolumeID, v.Token, "file", q("path", "/in/hello.txt", "force", "true"), []byte("from the API\n"))
	var e types.VolumeEntryStat
	if r.status != http.StatusCreated {
		t.Fatalf("PUT file: %v", r)
	}
	r.decode(t, &e)
	if e.Type != "file" || e.Size != 13 || e.UID != 1000 || e.Mode != 0o644 || e.Path != "/in/hello.txt" {
		t.Errorf("PUT file: %+v", e)
	}
	if r := d.content(t, "PUT", v.VolumeID, v.Token, "file", q("path", "/missing/x"), []byte("x")); r.status != http.StatusNotFound {
		t.Errorf("PUT under a missing directory without force: %v, want 404", r)
	}
	if r := d.content(t, "GET", v.VolumeID, v.Token, "file", q("path", "/in/hello.txt"), nil); r.status != http.StatusOK || string(r.body) != "from the API\n" {
		t.Errorf("GET file: %v", r)
	}
	if r := d.content(t, "POST", v.VolumeID, v.Token, "dir", q("path", "/made", "mode", "448"), nil); r.status != http.StatusCreated {
		t.Errorf("POST dir: %v", r)
	}
	if r := d.content(t, "POST", v.VolumeID, v.Token, "dir", q("path", "/made"), nil); r.status != http.StatusConflict {
		t.Errorf("POST dir of an existing one: %v, want 409", r)
	}
	if r := d.content(t, "PATCH", v.VolumeID, v.Token, "path", q("path", "/made"), []byte(`{"mode":493,"uid":0}`)); r.status != http.StatusOK {
		t.Errorf("PATCH path: %v", r)
	} else if r.decode(t, &e); e.Mode != 0o755 || e.UID != 0 || e.GID != 1000 {
		t.Errorf("PATCH path: %+v", e)
	}
	for _, bad := range []url.Values{q("path", "/made", "uid", "70000"), q("path", "/made", "mode", "99999"), q("path", "/made", "force", "maybe"), q()} {
		if r := d.content(t, "POST", v.VolumeID, v.Token, "dir", bad, nil); r.status != http.StatusBadRequest {
			t.Errorf("POST dir %v: %v, want 400", bad, r)
		}
	}
	var list []types.VolumeEntryStat
	d.content(t, "GET", v.VolumeID, v.Token, "dir", q("path", "/", "depth", "2"), nil).decode(t, &list)
	if len(list) != 3 || list[0].Path != "/in" || list[1].Path != "/in/hello.txt" || list[2].Path != "/made" {
		t.Errorf("GET dir depth 2: %+v", list)
	}
	if r := d.content(t, "GET", v.VolumeID, v.Token, "path", q("path", "/nothing"), nil); r.status != http.StatusNotFound {
		t.Errorf("GET path of nothing: %v, want 404", r)
	}
	if r := d.content(t, "DELETE", v.VolumeID, v.Token, "path", q("path", "/made"), nil); r.status != http.StatusNoContent {
		t.Errorf("DELETE path: %v", r)
	}

	// Mounted in a sandbox, then in another once the first is gone: what
	// user wrote in the first is user's in the second.
	mounts := []map[string]string{{"name": "data_1-A", "path": "/mnt/data"}}
	sb := d.create(t, key, map[string]any{"volumeMounts": mounts})
	if info := d.get(t, key, sb.SandboxID); len(info.VolumeMounts) != 1 || info.VolumeMounts[0] != (types.SandboxVolumeMount{Name: "data_1-A", Path: "/mnt/data"}) {
		t.Errorf("GET /sandboxes/%s: volumeMounts %+v", sb.SandboxID, info.VolumeMounts)
	}
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /mnt/data/in/hello.txt; echo inside > /mnt/data/in/written; mkdir /mnt/data/sub; stat -c '%U %G' /mnt/data/in/written"); out != "from the API\nuser user\n" {
		t.Errorf("in the sandbox: %q", out)
	}
	ac.Close()
	d.expect(t, http.StatusConflict, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: key})
	d.kill(t, key, sb.SandboxID)
	sb2 := d.create(t, key, map[string]any{"volumeMounts": mounts})
	ac = d.agent(sb2.SandboxID, sb2.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /mnt/data/in/written && echo again >> /mnt/data/in/written && stat -c '%U' /mnt/data/sub"); out != "inside\nuser\n" {
		t.Errorf("in the second sandbox: %q", out)
	}
	ac.Close()
	d.content(t, "GET", v.VolumeID, v.Token, "path", q("path", "/in/written"), nil).decode(t, &e)
	if e.UID != 1000 || e.GID != 1000 || e.Size != int64(len("inside\nagain\n")) {
		t.Errorf("the sandbox's file through the API: %+v; want uid and gid 1000, %d bytes", e, len("inside\nagain\n"))
	}
	d.kill(t, key, sb2.SandboxID)

	// Mounts a create may not have: 400, and nothing made.
	for _, bad := range []any{
		[]map[string]string{{"name": "nosuch", "path": "/mnt/x"}},
		[]map[string]string{{"name": "data_1-A", "path": "relative"}},
		[]map[string]string{{"name": "data_1-A", "path": "/proc/x"}},
		[]map[string]string{{"name": "data_1-A", "path": "/"}},
		[]map[string]string{{"name": "data_1-A", "path": "/home"}},
		[]map[string]string{{"name": "data_1-A", "path": "/usr/local/x"}},
		[]map[string]string{{"name": "data_1-A", "path": "/mnt/a"}, {"name": "data_1-A", "path": "/mnt/a/b"}},
		manyMounts(33),
	} {
		d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/v2/sandboxes", key: key,
			body: map[string]any{"templateID": "host", "volumeMounts": bad}, invalid: true})
	}
	// Another key cannot mount this key's volume by its name: it has its own.
	sb3 := d.create(t, other, map[string]any{"volumeMounts": mounts})
	ac = d.agent(sb3.SandboxID, sb3.EnvdAccessToken)
	if out := mustRun(t, ac, "ls -A /mnt/data | wc -l"); strings.TrimSpace(out) != "0" {
		t.Errorf("key 2's volume of the same name holds key 1's files: %q", out)
	}
	ac.Close()
	d.kill(t, other, sb3.SandboxID)

	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: key})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/volumes/" + v.VolumeID, key: key})
	if r := d.content(t, "GET", v.VolumeID, v.Token, "path", q("path", "/"), nil); r.status != http.StatusUnauthorized {
		t.Errorf("the token of a deleted volume: %v, want 401", r)
	}
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + ov.VolumeID, key: other})
}

// TestVolumeTokenBeforeBody: a content request without the volume's token
// is answered 401 before any of its body is read; the body is never taken.
func TestVolumeTokenBeforeBody(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "bomb")
	defer d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
	for _, tok := range []string{"", "wrong"} {
		c, err := net.Dial("tcp", d.api)
		if err != nil {
			t.Fatal(err)
		}
		hdr := "PUT /volumecontent/" + v.VolumeID + "/file?path=/bomb HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 1073741824\r\n"
		if tok != "" {
			hdr += "Authorization: Bearer " + tok + "\r\n"
		}
		if _, err := c.Write([]byte(hdr + "\r\n" + strings.Repeat("x", 1024))); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("token %q: no answer while the body is still to come: %v", tok, err)
		}
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("token %q: %d, want 401 before the body", tok, resp.StatusCode)
		}
		c.Close()
	}
	var list []types.VolumeEntryStat
	d.content(t, "GET", v.VolumeID, v.Token, "dir", q("path", "/"), nil).decode(t, &list)
	if len(list) != 0 {
		t.Errorf("after the refused uploads the volume holds %+v", list)
	}
}

// TestVolumeHostilePlanting: what a sandbox plants in a
// volume — symlinks to host paths and to .., a FIFO, a hard link, a tree
// deeper than the host walks — never leads the content API out of the
// volume, blocks it, or is written through; the outcome of each is stated.
func TestVolumeHostilePlanting(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "traps")
	secret, err := os.CreateTemp("", "cage-volume-secret-")
	if err != nil {
		t.Fatal(err)
	}
	secret.WriteString("host secret\n")
	secret.Close()
	t.Cleanup(func() { os.Remove(secret.Name()) })
	sb := d.create(t, d.key, map[string]any{"volumeMounts": []map[string]string{{"name": "traps", "path": "/vol"}}})
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	plant := "cd /vol && ln -s " + secret.Name() + " secret && ln -s /etc etc && ln -s .. up && ln -s / root && " +
		"mkfifo fifo && echo original > orig && ln orig hard && " +
		"p=deep; for i in $(seq 300); do p=$p/d; done; mkdir -p $p && echo ok"
	if out := mustRun(t, ac, plant); out != "ok\n" {
		t.Fatalf("planting: %q", out)
	}
	type outcome struct {
		method, op, path string
		body             []byte
		want             int
	}
	for _, c := range []outcome{
		{"GET", "file", "/secret", nil, http.StatusBadRequest},                   // a symlink to a host file: not followed
		{"GET", "file", "/etc/passwd", nil, http.StatusBadRequest},               // through a symlinked directory
		{"GET", "file", "/up/x", nil, http.StatusBadRequest},                     // through a symlink to ..
		{"GET", "dir", "/root", nil, http.StatusBadRequest},                      // listing a symlink to /
		{"GET", "file", "/fifo", nil, http.StatusBadRequest},                     // a FIFO: refused, not blocked on
		{"PUT", "file", "/etc/cage-planted", []byte("x"), http.StatusBadRequest}, // a write under a symlinked directory
		{"DELETE", "path", "/deep", nil, http.StatusBadRequest},                  // 300 deep: refused past 256, nothing removed
		{"PUT", "file", "/secret", []byte("replaced\n"), http.StatusCreated},     // the link itself is replaced
		{"PUT", "file", "/hard", []byte("new\n"), http.StatusCreated},            // the other name keeps its content
		{"DELETE", "path", "/root", nil, http.StatusNoContent},                   // the link goes, not /
		{"DELETE", "path", "/up", nil, http.StatusNoContent},
	} {
		done := make(chan reply, 1)
		go func() { done <- d.content(t, c.method, v.VolumeID, v.Token, c.op, q("path", c.path), c.body) }()
		select {
		case r := <-done:
			if r.status != c.want {
				t.Errorf("%s %s %s: %v, want %d", c.method, c.op, c.path, r, c.want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s %s %s: no answer in 30 s (blocked?)", c.method, c.op, c.path)
		}
	}
	if b, _ := os.ReadFile(secret.Name()); string(b) != "host secret\n" {
		t.Errorf("the host file a planted symlink named now reads %q", b)
	}
	if _, err := os.Stat("/etc/cage-planted"); err == nil {
		os.Remove("/etc/cage-planted")
		t.Errorf("a write under a planted symlink made /etc/cage-planted on the host")
	}
	for _, p := range []string{"/etc", "/", "/usr"} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s on the host: %v", p, err)
		}
	}
	if out := mustRun(t, ac, "cat /vol/orig /vol/hard; readlink /vol/etc; ls -d /vol/deep"); out != "original\nnew\n/etc\n/vol/deep\n" {
		t.Errorf("the volume after the API's operations, seen inside: %q", out)
	}
	var list []types.VolumeEntryStat
	d.content(t, "GET", v.VolumeID, v.Token, "dir", q("path", "/", "depth", "3"), nil).decode(t, &list)
	for _, e := range list {
		if strings.HasPrefix(e.Path, "/etc/") || e.Path == "/etc" && e.Type != "symlink" {
			t.Errorf("a listing followed the planted /etc link: %+v", e)
		}
	}

	// The race: the sandbox swaps a directory for a symlink to the host's
	// /tmp and back as fast as it can while the API writes into it and
	// lists it. Every write lands in the volume or is refused; none
	// reaches the host.
	hostDir := t.TempDir()
	if err := os.Chmod(hostDir, 0o777); err != nil {
		t.Fatal(err)
	}
	swapper := "cd /vol && end=$(($(date +%s)+4)); while [ $(date +%s) -lt $end ]; do rm -rf race; ln -s " +
		hostDir + " race; rm -f race; mkdir race; done; echo done"
	// The API goes on for as long as the swapper runs (a fixed number of
	// calls could all be made before a slow start of the swapper's
	// command, under load, and meet no swap at all). The link lives for a
	// moment in each swap; a loaded host may give the API none of those
	// moments in one round, so up to three rounds are run until it meets
	// one (every round's writes are checked all the same).
	landed, links, writes := 0, 0, 0
	for round := 0; round < 3 && links == 0; round++ {
		swapped := make(chan runResult, 1)
		go func() { swapped <- run(ac, swapper) }()
		var swap runResult
	swaps:
		for {
			select {
			case swap = <-swapped:
				break swaps
			default:
			}
			i := writes
			writes++
			name := "/race/w" + strconv.Itoa(i)
			switch r := d.content(t, "PUT", v.VolumeID, v.Token, "file", q("path", name, "force", "true"), []byte("x")); r.status {
			case http.StatusCreated:
				landed++
			case http.StatusBadRequest, http.StatusNotFound, http.StatusConflict:
			case http.StatusTooManyRequests:
				// Over the owner's content rate (a fast host makes more
				// than its burst in the swapper's seconds): the race goes
				// on after the wait it names.
				time.Sleep(time.Second)
			default:
				t.Errorf("PUT %s during the swaps: %v", name, r)
			}
			d.content(t, "GET", v.VolumeID, v.Token, "dir", q("path", "/race", "depth", "2"), nil)
			var e types.VolumeEntryStat
			if r := d.content(t, "GET", v.VolumeID, v.Token, "path", q("path", "/race"), nil); r.status == http.StatusOK {
				if r.decode(t, &e); e.Type == "symlink" {
					links++
				}
			}
		}
		if swap.stdout != "done\n" {
			t.Errorf("the swapper: %+v", swap)
		}
	}
	if ents, _ := os.ReadDir(hostDir); len(ents) > 0 {
		t.Errorf("writes during the swaps reached the host directory the symlink named: %d entries", len(ents))
	}
	if links == 0 {
		t.Errorf("the API never met the symlink in three rounds of swaps: the race was not run")
	}
	t.Logf("during the swaps %d of %d writes landed in the volume, the rest were refused; the API met the symlink %d times", landed, writes, links)
	d.kill(t, d.key, sb.SandboxID)
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
}

// TestVolumeOtherWalls: two volumes mounted on every wall present, of the
// host template and (where the shared store has it) the base image: a log
// each sandbox appends to keeps its owner across walls, and a volume of
// the configured size (volumes.max_size, 32M here) fills with ENOSPC
// inside.
func TestVolumeOtherWalls(t *testing.T) {
	t.Parallel()
	cfg := map[string]any{"network": map[string]any{"dns": testutil.SharedWorld(t).Upstreams()},
		"volumes": map[string]any{"max_size": "32M"}}
	templates := []string{"host"}
	if dir := os.Getenv("CAGE_TEMPLATES"); dir != "" {
		cfg["templates"] = dir
		templates = append(templates, "base")
	}
	p := filepath.Join(t.TempDir(), "volumes.json")
	b, _ := json.Marshal(cfg)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--config", p)
	v := d.createVolume(t, d.key, "walls")
	small := d.createVolume(t, d.key, "small")
	defer d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
	defer d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + small.VolumeID, key: d.key})
	mounts := []map[string]string{{"name": "walls", "path": "/home/user/vol"}, {"name": "small", "path": "/data/small"}}
	prev := ""
	for _, tmpl := range templates {
		for _, w := range []string{"runc", "gvisor", "process"} {
			if !wallHere(w) {
				if testutil.WallRequired(w) {
					t.Fatalf("wall %s is required here (CAGE_REQUIRE_WALLS) but is not on this host", w)
				}
				t.Logf("SKIP wall %s: not on this host", w)
				continue
			}
			sb := d.create(t, d.key, map[string]any{"templateID": tmpl, "wall": w, "volumeMounts": mounts})
			ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
			out := mustRun(t, ac, "cat /home/user/vol/log 2>/dev/null; echo "+tmpl+"-"+w+" >> /home/user/vol/log && stat -c '%U %a' /home/user/vol/log")
			if want := prev + "user 644\n"; out != want {
				t.Errorf("%s on %s: %q, want %q", tmpl, w, out, want)
			}
			prev += tmpl + "-" + w + "\n"
			t.Logf("%s on %s: the log reads back, owner user", tmpl, w)
			r := run(ac, "dd if=/dev/zero of=/data/small/fill bs=1M count=64 2>&1; sync; rm -f /data/small/fill")
			if !strings.Contains(r.stdout, "No space left on device") {
				t.Errorf("%s on %s: 64 MiB into a 32 MiB volume: %q (exit %d), want ENOSPC", tmpl, w, r.stdout, r.exit)
			}
			ac.Close()
			d.kill(t, d.key, sb.SandboxID)
		}
	}
	d.expect(t, http.StatusBadRequest, call{method: "POST", path: "/v2/sandboxes", key: d.key,
		body: map[string]any{"templateID": "base", "wall": "microvm", "volumeMounts": mounts}})
}

func wallHere(w string) bool {
	switch w {
	case "runc":
		_, err := exec.LookPath("runc")
		return err == nil
	case "gvisor":
		if p := os.Getenv("CAGE_RUNSC"); p != "" {
			_, err := os.Stat(p)
			return err == nil
		}
		_, err := exec.LookPath("runsc")
		return err == nil
	case "microvm":
		_, qerr := exec.LookPath("qemu-system-x86_64")
		_, kerr := os.Stat(filepath.Join(testutil.KernelDir(), "current"))
		return qerr == nil && kerr == nil
	}
	return true
}

// TestVolumePauseResume: a sandbox paused without its memory keeps its
// volume mounted in its record (the volume cannot be deleted under it); the
// volume is not part of the files saved, so what was written to it while
// the sandbox was paused is there after the resume, not overwritten; a
// snapshot leaves the volume out too.
func TestVolumePauseResume(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "kept")
	mounts := []map[string]string{{"name": "kept", "path": "/mnt/kept"}}
	sb := d.create(t, d.key, map[string]any{"volumeMounts": mounts})
	ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
	mustRun(t, ac, "echo before > /mnt/kept/f && echo home > /home/user/h")
	ac.Close()
	d.expect(t, http.StatusNoContent, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/pause", key: d.key, body: map[string]any{"memory": false}})
	d.expect(t, http.StatusConflict, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
	if r := d.content(t, "PUT", v.VolumeID, v.Token, "file", q("path", "/f"), []byte("while paused\n")); r.status != http.StatusCreated {
		t.Fatalf("PUT while paused: %v", r)
	}
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/v2/sandboxes/" + sb.SandboxID + "/connect", key: d.key, body: map[string]any{"timeout": 120}})
	ac = d.agent(sb.SandboxID, sb.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /mnt/kept/f /home/user/h"); out != "while paused\nhome\n" {
		t.Errorf("after resume from files: %q, want the volume as written while paused and the sandbox's own file", out)
	}
	ac.Close()
	r := d.expect(t, http.StatusCreated, call{method: "POST", path: "/sandboxes/" + sb.SandboxID + "/snapshots", key: d.key, body: map[string]any{}})
	var snap types.SnapshotInfo
	r.decode(t, &snap)
	d.kill(t, d.key, sb.SandboxID)
	fork := d.create(t, d.key, map[string]any{"templateID": snap.SnapshotID})
	ac = d.agent(fork.SandboxID, fork.EnvdAccessToken)
	if out := mustRun(t, ac, "cat /home/user/h; ls -A /mnt/kept 2>/dev/null | wc -l"); out != "home\n0\n" {
		t.Errorf("a sandbox from the snapshot, without the volume: %q; want its home file and nothing of the volume", out)
	}
	ac.Close()
	d.kill(t, d.key, fork.SandboxID)
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/templates/" + url.PathEscape(snap.SnapshotID), key: d.key})
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
}

// TestVolumeAcrossRestart: a sandbox keeps its volume mounted while the
// daemon stops (SIGTERM: the host's mount goes) or dies (kill -9: it
// stays); the next daemon mounts the same file system again, never a
// second one of the same bytes: what the API writes, the running sandbox
// reads, and the other way round.
func TestVolumeAcrossRestart(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	v := d.createVolume(t, d.key, "lasting")
	sb := d.create(t, d.key, map[string]any{"volumeMounts": []map[string]string{{"name": "lasting", "path": "/mnt/v"}}})
	for i, restart := range []func(*testing.T){d.stop, d.kill9} {
		restart(t)
		d.start(t)
		name := "/after-" + strconv.Itoa(i)
		if r := d.content(t, "PUT", v.VolumeID, v.Token, "file", q("path", name), []byte("from the API\n")); r.status != http.StatusCreated {
			t.Fatalf("PUT %s after restart %d: %v", name, i, r)
		}
		ac := d.agent(sb.SandboxID, sb.EnvdAccessToken)
		if out := mustRun(t, ac, "cat /mnt/v"+name+" && echo inside > /mnt/v/inside-"+strconv.Itoa(i)); out != "from the API\n" {
			t.Errorf("after restart %d the sandbox reads %q of what the API wrote", i, out)
		}
		ac.Close()
		if r := d.content(t, "GET", v.VolumeID, v.Token, "file", q("path", "/inside-"+strconv.Itoa(i)), nil); string(r.body) != "inside\n" {
			t.Errorf("after restart %d the API reads %v of what the sandbox wrote", i, r)
		}
	}
	if n := loopsOf(t, d.data); n != 1 {
		t.Errorf("%d loop devices hold the volume's image, want 1", n)
	}
	d.kill(t, d.key, sb.SandboxID)
	d.expect(t, http.StatusNoContent, call{method: "DELETE", path: "/volumes/" + v.VolumeID, key: d.key})
}

// loopsOf counts the loop devices whose backing file is under dir.
func loopsOf(t *testing.T, dir string) int {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), dir) {
			n++
		}
	}
	return n
}

// manyMounts is n mounts of the volume data_1-A.
func manyMounts(n int) []map[string]string {
	var out []map[string]string
	for i := 0; i < n; i++ {
		out = append(out, map[string]string{"name": "data_1-A", "path": "/mnt/m" + strconv.Itoa(i)})
	}
	return out
}
