package agent

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cagehq/cage/api/gen/filesystem"
)

// filesReq sends a /files request; hdr may carry a token or other headers.
func (e *fsEnv) filesReq(method string, q url.Values, body io.Reader, hdr map[string]string) (int, []byte) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+"/files?"+q.Encode(), body)
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		return 0, nil
	}
	defer res.Body.Close()
	data, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		var je struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if err := json.Unmarshal(data, &je); err != nil || je.Code != res.StatusCode || je.Message == "" {
			e.t.Errorf("error reply %d is not E2B-shaped JSON: %s", res.StatusCode, data)
		}
	}
	return res.StatusCode, data
}

var fsTokenHeader = map[string]string{"X-Access-Token": fsTestToken}

func (e *fsEnv) upload(p, data string) int {
	code, _ := e.filesReq("POST", url.Values{"path": {p}}, strings.NewReader(data),
		map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"})
	return code
}

func (e *fsEnv) download(p string) (int, string) {
	code, data := e.filesReq("GET", url.Values{"path": {p}}, nil, fsTokenHeader)
	return code, string(data)
}

func fsSign(path, op, user string, exp int64) string {
	raw := path + ":" + op + ":" + user + ":" + fsTestToken
	if exp != 0 {
		raw += ":" + strconv.FormatInt(exp, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

func TestFilesUpload(t *testing.T) {
	e := newFSEnv(t)
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	for name, data := range map[string]string{"one.txt": "1", "/home/user/new/dir/two.txt": "22", "~/three": "333"} {
		fw, _ := mw.CreateFormFile("file", name)
		fw.Write([]byte(data))
	}
	mw.WriteField("other", "ignored")
	mw.Close()
	code, data := e.filesReq("POST", url.Values{"username": {"user"}}, &body,
		map[string]string{"X-Access-Token": fsTestToken, "Content-Type": mw.FormDataContentType()})
	var got []map[string]string
	if code != 200 || json.Unmarshal(data, &got) != nil || len(got) != 3 {
		t.Fatalf("multipart upload: %d %s", code, data)
	}
	for _, en := range got {
		if en["type"] != "file" || en["name"] != filepath.Base(en["path"]) || !strings.HasPrefix(en["path"], "/home/user/") {
			t.Errorf("entry %v", en)
		}
	}
	for p, want := range map[string]string{"one.txt": "1", "new/dir/two.txt": "22", "three": "333"} {
		fi, err := os.Stat(filepath.Join(e.home, p))
		if c, d := e.download("~/" + p); c != 200 || d != want || err != nil || fileOwner(fi) != [2]int{e.uid, e.gid} || fi.Mode() != 0o644 {
			t.Errorf("%s: %d %q %v %v", p, c, d, err, fi)
		}
	}
	if fi, err := os.Stat(filepath.Join(e.home, "new")); err != nil || fileOwner(fi) != [2]int{e.uid, e.gid} {
		t.Errorf("created parent not owned by the user: %v", err)
	}

	// Raw bodies, plain and gzip-encoded; overwriting keeps the file's mode.
	os.Chmod(filepath.Join(e.home, "one.txt"), 0o600)
	if code := e.upload("one.txt", "raw"); code != 200 {
		t.Fatal(code)
	}
	if fi, _ := os.Stat(filepath.Join(e.home, "one.txt")); fi.Mode() != 0o600 {
		t.Errorf("mode after overwrite: %v", fi.Mode())
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(bytes.Repeat([]byte("zip"), 1000))
	zw.Close()
	code, _ = e.filesReq("POST", url.Values{"path": {"z"}}, &gz, map[string]string{"X-Access-Token": fsTestToken,
		"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	if c, d := e.download("z"); code != 200 || c != 200 || d != strings.Repeat("zip", 1000) {
		t.Fatalf("gzip upload: %d %d %d bytes", code, c, len(d))
	}

	for p, want := range map[string]int{"~": 400, "/": 400, "z/under-a-file": 400} {
		if c := e.upload(p, "x"); c != want {
			t.Errorf("upload %q: %d, want %d", p, c, want)
		}
	}
	code, _ = e.filesReq("POST", url.Values{"path": {"x"}}, strings.NewReader("x"), fsTokenHeader)
	if code != 400 {
		t.Errorf("upload without a content type: %d", code)
	}
	e.checkNoTemps()
}

func TestFilesDownload(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "z"), strings.Repeat("zip", 1000))
	e.mustWrite(filepath.Join(e.home, "empty"), "")
	if err := unix.Mkfifo(filepath.Join(e.home, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	if c, d := e.download("empty"); c != 200 || d != "" {
		t.Errorf("empty file: %d %q", c, d)
	}
	// Compressed on request.
	req, _ := http.NewRequest("GET", e.srv.URL+"/files?path=z", nil)
	req.Header.Set("X-Access-Token", fsTestToken)
	req.Header.Set("Accept-Encoding", "gzip")
	res, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	zr, err := gzip.NewReader(res.Body)
	if err != nil || res.Header.Get("Content-Encoding") != "gzip" || res.Header.Get("Content-Type") != "application/octet-stream" ||
		!strings.Contains(res.Header.Get("Content-Disposition"), `filename=z`) {
		t.Fatalf("gzip download: %v %v", err, res.Header)
	}
	if plain, _ := io.ReadAll(zr); string(plain) != strings.Repeat("zip", 1000) {
		t.Fatalf("gzip download content: %d bytes", len(plain))
	}

	// Ranges are served from the plain file.
	req, _ = http.NewRequest("GET", e.srv.URL+"/files?path=z", nil)
	req.Header.Set("X-Access-Token", fsTestToken)
	req.Header.Set("Range", "bytes=3-5")
	res2, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res2.Body.Close()
	if part, _ := io.ReadAll(res2.Body); res2.StatusCode != http.StatusPartialContent || string(part) != "zip" {
		t.Errorf("range: %d %q", res2.StatusCode, part)
	}
	for p, want := range map[string]int{"~": 400, "missing": 404, "": 400, "fifo": 400} {
		if c, _ := e.download(p); c != want {
			t.Errorf("download %q: %d, want %d", p, c, want)
		}
	}
	code, _ := e.filesReq("GET", url.Values{"path": {"z"}, "username": {"nobody"}}, nil, fsTokenHeader)
	if code != 400 {
		t.Errorf("unknown user: %d", code)
	}
}

// checkNoTemps fails if an upload left a temporary file anywhere in the
// root, once every handler has returned: a streamed answer can reach the
// client before its handler's clean-up has run.
func (e *fsEnv) checkNoTemps() {
	e.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); e.inflight.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	filepath.Walk(e.root, func(p string, fi os.FileInfo, err error) error {
		if err == nil && strings.HasPrefix(fi.Name(), uploadTempPrefix) {
			e.t.Errorf("temporary upload file left: %s", p)
		}
		return nil
	})
}

// failingReader yields some data, then an error, like a client going away.
type failingReader struct{ n int }

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("client went away")
	}
	n := min(len(p), f.n)
	f.n -= n
	return n, nil
}

func TestFilesFailedUploadLeavesNothing(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "keep"), "original")
	for _, p := range []string{"fresh", "keep"} {
		code, _ := e.filesReq("POST", url.Values{"path": {p}}, &failingReader{n: 1 << 20},
			map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"})
		if code == 200 {
			t.Fatalf("%s: broken upload accepted", p)
		}
	}
	// The client gave up before the handler saw the body end, perhaps
	// before the handler had even made its temporary file: Close waits
	// until every handler has returned (a wait for the file to go away
	// passed at once when it was not there yet, and CI saw it made after).
	e.srv.Close()
	if _, err := os.Stat(filepath.Join(e.home, "fresh")); !os.IsNotExist(err) {
		t.Errorf("half-written file left: %v", err)
	}
	if got, _ := os.ReadFile(filepath.Join(e.home, "keep")); string(got) != "original" {
		t.Errorf("existing file changed to %q", got)
	}
	e.checkNoTemps()
}

func TestFilesAuth(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "f"), "data")
	future, past := time.Now().Add(time.Hour).Unix(), time.Now().Add(-time.Minute).Unix()
	q := func(kv ...string) url.Values {
		v := url.Values{}
		for i := 0; i < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}
	cases := []struct {
		name string
		q    url.Values
		hdr  map[string]string
		want int
	}{
		{"no token", q("path", "f"), nil, 401},
		{"wrong token", q("path", "f"), map[string]string{"X-Access-Token": "nope"}, 401},
		{"token", q("path", "f"), fsTokenHeader, 200},
		{"signature", q("path", "f", "signature", fsSign("f", "read", "", 0)), nil, 200},
		{"signature with user", q("path", "f", "username", "user", "signature", fsSign("f", "read", "user", 0)), nil, 200},
		{"signature, other user", q("path", "f", "username", "root", "signature", fsSign("f", "read", "user", 0)), nil, 401},
		{"signature, other path", q("path", "g", "signature", fsSign("f", "read", "", 0)), nil, 401},
		{"write signature", q("path", "f", "signature", fsSign("f", "write", "", 0)), nil, 401},
		{"wrong signature", q("path", "f", "signature", "v1_AAAA"), nil, 401},
		{"expiring", q("path", "f", "signature", fsSign("f", "read", "", future),
			"signature_expiration", fmt.Sprint(future)), nil, 200},
		{"expired", q("path", "f", "signature", fsSign("f", "read", "", past),
			"signature_expiration", fmt.Sprint(past)), nil, 401},
		{"expiration not signed", q("path", "f", "signature", fsSign("f", "read", "", 0),
			"signature_expiration", fmt.Sprint(future)), nil, 401},
	}
	for _, c := range cases {
		if code, _ := e.filesReq("GET", c.q, nil, c.hdr); code != c.want {
			t.Errorf("%s: %d, want %d", c.name, code, c.want)
		}
	}
	wq := q("path", "up", "signature", fsSign("up", "write", "", future), "signature_expiration", fmt.Sprint(future))
	code, _ := e.filesReq("POST", wq, strings.NewReader("signed"), map[string]string{"Content-Type": "application/octet-stream"})
	if got, _ := os.ReadFile(filepath.Join(e.home, "up")); code != 200 || string(got) != "signed" {
		t.Errorf("signed upload: %d %q", code, got)
	}
	code, _ = e.filesReq("POST", q("path", "up2"), strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"})
	if code != 401 {
		t.Errorf("unsigned upload: %d", code)
	}
}

func TestFilesDiskFull(t *testing.T) {
	e := newFSEnv(t)
	small := filepath.Join(e.home, "small")
	os.Mkdir(small, 0o755)
	if err := unix.Mount("tmpfs", small, "tmpfs", 0, "size=64k"); err != nil {
		t.Skipf("cannot mount a small tmpfs: %v", err)
	}
	defer unix.Unmount(small, unix.MNT_DETACH)
	code, data := e.filesReq("POST", url.Values{"path": {"small/big"}}, bytes.NewReader(make([]byte, 1<<20)),
		map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"})
	if code != http.StatusInsufficientStorage {
		t.Fatalf("full disk: %d %s", code, data)
	}
	e.checkNoTemps()
}

// TestFilesHostile tries to read and write outside the root through /files.
func TestFilesHostile(t *testing.T) {
	e := newFSEnv(t)
	rel := strings.Repeat("../", 12) + strings.TrimPrefix(e.outside, "/")
	e.symlink(e.canary, "home/user/canarylink") // a link to a host file
	e.symlink(e.outside, "home/user/outdir")    // a link to a host directory
	e.symlink(rel, "home/user/climb")           // relative, climbing
	e.symlink("/proc/self/root"+e.outside, "home/user/pr")
	e.symlink("/proc/1/root"+e.outside, "home/user/p1")
	e.symlink("/etc/passwd", "home/user/passwdlink") // the sandbox's, not the host's

	if c, d := e.download("../../../../etc/passwd"); c != 200 || d != "sandbox passwd\n" {
		t.Fatalf("../ download: %d %q", c, d)
	}
	if c, d := e.download("passwdlink"); c != 200 || d != "sandbox passwd\n" {
		t.Fatalf("absolute link download: %d %q", c, d)
	}
	for _, p := range []string{"canarylink", "outdir/canary", "climb/canary", "pr/canary", "p1/canary",
		rel + "/canary", "/proc/self/root" + e.canary} {
		if c, d := e.download(p); c == 200 || strings.Contains(d, "canary:") {
			t.Errorf("download %s escaped: %d %q", p, c, d)
		}
		e.upload(p, "EVIL")
		e.upload(p+"-new", "EVIL")
	}
	// The write through canarylink replaced the dangling link, in the root.
	if got, _ := os.ReadFile(filepath.Join(e.home, "canarylink")); string(got) != "EVIL" {
		t.Errorf("upload over a dangling link: %q", got)
	}
	// e.checkCanary runs at cleanup.
}

// TestFilesSymlinkSwapRace flips a directory and a symlink to the outside
// while files are read and written through it.
func TestFilesSymlinkSwapRace(t *testing.T) {
	e := newFSEnv(t)
	e.mustWrite(filepath.Join(e.home, "race/canary"), "inside\n")
	if err := os.Symlink(e.outside, filepath.Join(e.home, "race.alt")); err != nil {
		t.Fatal(err)
	}
	rel := strings.Repeat("../", 12) + strings.TrimPrefix(e.outside, "/")
	if err := os.Symlink(rel, filepath.Join(e.home, "race.rel")); err != nil {
		t.Fatal(err)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		race, alt, relLink := filepath.Join(e.home, "race"), filepath.Join(e.home, "race.alt"), filepath.Join(e.home, "race.rel")
		for i := 0; !stop.Load(); i++ {
			other := alt
			if i%2 == 1 {
				other = relLink
			}
			unix.Renameat2(unix.AT_FDCWD, race, unix.AT_FDCWD, other, unix.RENAME_EXCHANGE)
		}
	}()
	ctx := context.Background()
	deadline := time.Now().Add(2 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		if _, d := e.download("race/canary"); strings.Contains(d, "canary:") {
			t.Fatalf("read the outside canary")
		}
		e.upload("race/canary", "EVIL")
		e.upload(fmt.Sprintf("race/new%d", i), "EVIL")
		e.c().Stat(ctx, connect.NewRequest(&pb.StatRequest{Path: "race/canary"}))
		if es, err := e.list("race", 1); err == nil {
			for _, en := range es {
				if en.GetSize() == int64(len(fsCanaryData)) {
					t.Fatalf("listed the outside canary: %v", en)
				}
			}
		}
		e.c().MakeDir(ctx, connect.NewRequest(&pb.MakeDirRequest{Path: fmt.Sprintf("race/dir%d", i)}))
		e.c().Move(ctx, connect.NewRequest(&pb.MoveRequest{Source: "race/canary", Destination: "race/canary"}))
		e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: fmt.Sprintf("race/new%d", i)}))
		e.c().Remove(ctx, connect.NewRequest(&pb.RemoveRequest{Path: "race/canary"}))
	}
	stop.Store(true)
	wg.Wait()
	// e.checkCanary runs at cleanup.
}

// TestFilesSlowTransfersHoldNoWorker: whoever holds a signed upload or
// download URL of a sandbox (E2B's way to let a browser move one file)
// opens more transfers than the agent has file workers (fileWorkers) and
// lets none move: uploads announce a body and send a byte of it, downloads
// of a large file read none of the answer. Expected: every other file
// operation of the sandbox (a stat, a small upload, a download) is served
// meanwhile, and the stalled transfers complete once their clients move.
// Found by review, 2026-12-04: an upload read its body, and a download
// wrote its answer, while holding one of the agent's 4 file workers, so
// four stalled transfers (or four slow honest ones) held every file
// operation of the sandbox for as long as their clients liked.
func TestFilesSlowTransfersHoldNoWorker(t *testing.T) {
	e := newFSEnv(t)
	big := filepath.Join(e.home, "big.bin")
	e.mustWrite(big, "")
	if err := os.Truncate(big, 256<<20); err != nil { // more than any socket buffers hold
		t.Fatal(err)
	}
	addr := strings.TrimPrefix(e.srv.URL, "http://")
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	dial := func(req string) net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if _, err := io.WriteString(c, req); err != nil {
			t.Fatal(err)
		}
		return c
	}
	var uploads []net.Conn
	for i := range fileWorkers + 1 {
		p := fmt.Sprintf("/home/user/slow-%d", i)
		q := url.Values{"path": {p}, "username": {"user"}, "signature": {fsSign(p, "write", "user", 0)}}
		uploads = append(uploads, dial("POST /files?"+q.Encode()+" HTTP/1.1\r\nHost: agent\r\n"+
			"Content-Type: application/octet-stream\r\nContent-Length: 2\r\n\r\nx"))
	}
	q := url.Values{"path": {"/home/user/big.bin"}, "username": {"user"}, "signature": {fsSign("/home/user/big.bin", "read", "user", 0)}}
	for range fileWorkers + 1 {
		dial("GET /files?" + q.Encode() + " HTTP/1.1\r\nHost: agent\r\nAccept-Encoding: identity\r\n\r\n")
	}
	time.Sleep(time.Second) // every transfer has its handler (and, before the fix, a worker)

	done := make(chan string, 1)
	go func() {
		if _, err := e.stat("/home/user/big.bin"); err != nil {
			done <- "stat: " + err.Error()
			return
		}
		if code := e.upload("/home/user/small", "small"); code != http.StatusOK {
			done <- fmt.Sprintf("small upload: %d", code)
			return
		}
		if code, got := e.download("/home/user/small"); code != http.StatusOK || got != "small" {
			done <- fmt.Sprintf("small download: %d %q", code, got)
			return
		}
		done <- ""
	}()
	select {
	case msg := <-done:
		if msg != "" {
			t.Fatal(msg)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%d stalled uploads and downloads held the sandbox's other file operations for 10 s", 2*(fileWorkers+1))
	}
	// The stalled uploads complete once their bodies arrive.
	for i, c := range uploads {
		if _, err := io.WriteString(c, "y"); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
			t.Fatalf("upload %d once its body came: %q %v", i, line, err)
		}
		got, err := os.ReadFile(filepath.Join(e.home, fmt.Sprintf("slow-%d", i)))
		if err != nil || string(got) != "xy" {
			t.Errorf("upload %d wrote %q, %v", i, got, err)
		}
	}
}

// TestFilesPartHeaderBounded: whoever may upload (a signed URL's holder
// too) sends multipart parts whose headers are megabytes long. Expected:
// a part's boundary and header are read to at most partbound.MaxHeader bytes,
// past it a 400 that names the bound and nothing written; a part that
// is not a file may still be large (its body is read past, not kept).
// Found by review, 2026-12-04: Go's multipart reader keeps up to 10 MiB
// of a part's header while it reads it, so each upload that sent 8 MiB of
// one and held the rest back held 8 MiB of the agent's memory (the
// sandbox's) for as long as its client liked, a hundred of them from one
// address the sandbox's memory limit.
func TestFilesPartHeaderBounded(t *testing.T) {
	e := newFSEnv(t)
	post := func(body *bytes.Buffer, ctype string) (int, []byte) {
		return e.filesReq("POST", url.Values{"username": {"user"}}, body,
			map[string]string{"X-Access-Token": fsTestToken, "Content-Type": ctype})
	}
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	h := make(textproto.MIMEHeader)
	h.Set("Content-Disposition", `form-data; name="file"; filename="/home/user/padded"`)
	h.Set("X-Pad", strings.Repeat("a", 1<<20))
	fw, _ := mw.CreatePart(h)
	fw.Write([]byte("data"))
	mw.Close()
	code, data := post(&body, mw.FormDataContentType())
	if code != http.StatusBadRequest || !strings.Contains(string(data), "65536") {
		t.Errorf("a part with a header of 1 MiB: %d %s, want 400 naming the bound", code, data)
	}
	if _, err := os.Lstat(filepath.Join(e.home, "padded")); !os.IsNotExist(err) {
		t.Errorf("the part with a header of 1 MiB was written: %v", err)
	}
	body.Reset()
	mw = multipart.NewWriter(&body)
	mw.WriteField("other", strings.Repeat("b", 1<<20))
	fw, _ = mw.CreateFormFile("file", "/home/user/after-big-field")
	fw.Write([]byte("ok"))
	mw.Close()
	if code, data := post(&body, mw.FormDataContentType()); code != http.StatusOK {
		t.Errorf("an upload with a field of 1 MiB before its file: %d %s", code, data)
	}
	if got, err := os.ReadFile(filepath.Join(e.home, "after-big-field")); err != nil || string(got) != "ok" {
		t.Errorf("the file after a field of 1 MiB: %q %v", got, err)
	}
	e.checkNoTemps()
}

// TestFilesUploadListBounded: a path-less multipart upload (each part's
// filename names its file, as E2B's SDK sends files.write of several)
// lists 2,000 files of 4 KB paths. Expected: a 413 in envd's error shape
// that names the bound (4 MiB of paths, names and metadata listed) once
// the list would pass it; the files before that part written whole, that
// part and those after it not written, no temporary file left. 1,000
// files of ordinary paths are written and listed. Found by review,
// 2026-12-05: 10,000 files of 4 KB paths held some 80 MiB of the agent
// (the sandbox's memory) and built an answer of 38 MB whole.
func TestFilesUploadListBounded(t *testing.T) {
	e := newFSEnv(t)
	post := func(body *bytes.Buffer, ctype string) (int, []byte) {
		return e.filesReq("POST", url.Values{"username": {"user"}}, body,
			map[string]string{"X-Access-Token": fsTestToken, "Content-Type": ctype})
	}
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	for i := range 1000 {
		fw, _ := mw.CreateFormFile("file", fmt.Sprintf("/home/user/project/src/pkg%02d/file%04d.go", i%50, i))
		fmt.Fprintf(fw, "package p%d\n", i)
	}
	mw.Close()
	code, data := post(&body, mw.FormDataContentType())
	var got []map[string]any
	if code != http.StatusOK || json.Unmarshal(data, &got) != nil || len(got) != 1000 {
		t.Fatalf("an upload of 1,000 files: %d, %d bytes, want 200 listing 1,000 files", code, len(data))
	}

	dir := "/home/user"
	for i := range 15 {
		dir += "/" + strings.Repeat(string(rune('a'+i)), 250)
	}
	body.Reset()
	mw = multipart.NewWriter(&body)
	for i := range 2000 {
		fw, _ := mw.CreateFormFile("file", fmt.Sprintf("%s/f%05d", dir, i))
		fw.Write([]byte("x"))
	}
	mw.Close()
	code, data = post(&body, mw.FormDataContentType())
	if code != http.StatusRequestEntityTooLarge || !strings.Contains(string(data), "4194304") {
		t.Fatalf("2,000 files of 4 KB paths: %d %.300s, want 413 naming the bound", code, data)
	}
	var je struct{ Message string }
	_ = json.Unmarshal(data, &je)
	var written int
	if m := regexp.MustCompile(`the (\d+) files before it were written`).FindStringSubmatch(je.Message); m != nil {
		written, _ = strconv.Atoi(m[1])
	}
	if written < 1000 || written >= 2000 {
		t.Fatalf("the answer does not say how many files were written: %q", je.Message)
	}
	hostDir := filepath.Join(e.root, dir)
	for i, want := range map[int]bool{0: true, written - 1: true, written: false, 1999: false} {
		got, err := os.ReadFile(filepath.Join(hostDir, fmt.Sprintf("f%05d", i)))
		if want && (err != nil || string(got) != "x") {
			t.Errorf("file %d, before the bound: %q %v, want written", i, got, err)
		}
		if !want && !os.IsNotExist(err) {
			t.Errorf("file %d, past the bound: %q %v, want not written", i, got, err)
		}
	}
	t.Logf("%d files of %d-byte paths written before the bound: %s", written, len(dir)+7, je.Message)
	e.checkNoTemps()
}
