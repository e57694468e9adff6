package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cagehq/cage/api/gen/filesystem"
)

// uploadMD uploads data to p as an octet stream with extra headers and
// returns the status and the reply's entries.
func (e *fsEnv) uploadMD(p, data string, hdr map[string]string) (int, []uploadedEntry) {
	e.t.Helper()
	h := map[string]string{"X-Access-Token": fsTestToken, "Content-Type": "application/octet-stream"}
	maps.Copy(h, hdr)
	code, body := e.filesReq("POST", url.Values{"path": {p}}, strings.NewReader(data), h)
	var got []uploadedEntry
	if code == http.StatusOK {
		if err := json.Unmarshal(body, &got); err != nil {
			e.t.Fatalf("upload reply %s: %v", body, err)
		}
	}
	return code, got
}

// TestFilesMetadata holds E2B's file metadata: X-Metadata-* headers on an
// upload (octet stream or multipart) are kept on the file, keys lowercased,
// and come back from the upload, Stat, ListDir and Move; the next upload
// replaces them all.
func TestFilesMetadata(t *testing.T) {
	e := newFSEnv(t)
	md := map[string]string{"owner": "alice", "purpose": "a b=c&d", "n": ""}
	code, got := e.uploadMD("doc.txt", "hello", map[string]string{
		"X-Metadata-Owner": "alice", "x-metadata-PURPOSE": "a b=c&d", "X-Metadata-N": "", "X-Other": "no"})
	if code != 200 || len(got) != 1 || !maps.Equal(got[0].Metadata, md) {
		t.Fatalf("upload with metadata: %d %+v, want metadata %v", code, got, md)
	}
	if v, err := unixGetxattr(filepath.Join(e.home, "doc.txt"), "user.e2b.owner"); err != nil || v != "alice" {
		t.Errorf("xattr user.e2b.owner on disk: %q %v", v, err)
	}
	if en, err := e.stat("doc.txt"); err != nil || !maps.Equal(en.GetMetadata(), md) {
		t.Errorf("stat: %v %v, want metadata %v", en, err, md)
	}
	es, err := e.list("~", 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range es {
		if en.GetName() == "doc.txt" && !maps.Equal(en.GetMetadata(), md) {
			t.Errorf("list: %v, want metadata %v", en, md)
		}
	}
	res, err := e.c().Move(context.Background(), connect.NewRequest(&pb.MoveRequest{Source: "doc.txt", Destination: "moved.txt"}))
	if err != nil || !maps.Equal(res.Msg.GetEntry().GetMetadata(), md) {
		t.Errorf("move keeps metadata: %v %v", res, err)
	}

	// An upload replaces the file's metadata: other keys, or none.
	if code, got := e.uploadMD("moved.txt", "v2", map[string]string{"X-Metadata-Version": "2"}); code != 200 || !maps.Equal(got[0].Metadata, map[string]string{"version": "2"}) {
		t.Errorf("second upload: %d %+v", code, got)
	}
	if en, _ := e.stat("moved.txt"); !maps.Equal(en.GetMetadata(), map[string]string{"version": "2"}) {
		t.Errorf("after a second upload: %v", en.GetMetadata())
	}
	if code, got := e.uploadMD("moved.txt", "v3", nil); code != 200 || got[0].Metadata != nil {
		t.Errorf("upload without metadata: %d %+v", code, got)
	}
	if en, _ := e.stat("moved.txt"); len(en.GetMetadata()) != 0 {
		t.Errorf("upload without metadata left %v", en.GetMetadata())
	}

	// Multipart: every file of the upload gets the request's metadata.
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	for _, name := range []string{"m/one", "m/two"} {
		fw, _ := mw.CreateFormFile("file", name)
		fw.Write([]byte(name))
	}
	mw.Close()
	code, data := e.filesReq("POST", url.Values{}, &body, map[string]string{"X-Access-Token": fsTestToken,
		"Content-Type": mw.FormDataContentType(), "X-Metadata-Batch": "7"})
	if code != 200 {
		t.Fatalf("multipart with metadata: %d %s", code, data)
	}
	es, err = e.list("m", 1)
	if err != nil || len(es) != 2 {
		t.Fatalf("list m: %v %v", es, err)
	}
	for _, en := range es {
		if !maps.Equal(en.GetMetadata(), map[string]string{"batch": "7"}) {
			t.Errorf("multipart file %s: metadata %v", en.GetName(), en.GetMetadata())
		}
	}
	// A directory has none unless set; a file set from inside the
	// sandbox under another prefix shows none either.
	e.mustWrite(filepath.Join(e.home, "plain"), "x")
	if err := unix.Setxattr(filepath.Join(e.home, "plain"), "user.other", []byte("v"), 0); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"m", "plain"} {
		if en, err := e.stat(p); err != nil || en.GetMetadata() != nil {
			t.Errorf("stat %s: %v %v, want no metadata", p, en.GetMetadata(), err)
		}
	}
	e.checkNoTemps()
}

// TestFilesMetadataBounds refuses, with a 400 and nothing written,
// metadata outside E2B's bounds: printable ASCII, keys of at most 246
// bytes, 4096 bytes in all with the prefix counted per key.
func TestFilesMetadataBounds(t *testing.T) {
	e := newFSEnv(t)
	big := map[string]string{}
	for i := 0; i < 9; i++ {
		big["X-Metadata-K"+string(rune('a'+i))] = strings.Repeat("v", 450) // 9 × (9+2+450) = 4149
	}
	ok := map[string]string{}
	for i := 0; i < 8; i++ {
		ok["X-Metadata-K"+string(rune('a'+i))] = strings.Repeat("v", 450) // 3688
	}
	for name, c := range map[string]struct {
		hdr  map[string]string
		want int
	}{
		"key of 246 bytes":      {map[string]string{"X-Metadata-" + strings.Repeat("k", 246): "v"}, 200},
		"key of 247 bytes":      {map[string]string{"X-Metadata-" + strings.Repeat("k", 247): "v"}, 400},
		"tab in a value":        {map[string]string{"X-Metadata-A": "x\ty"}, 400},
		"non-ASCII value":       {map[string]string{"X-Metadata-A": "caf\xc3\xa9"}, 400},
		"4149 bytes in all":     {big, 400},
		"3688 bytes in all":     {ok, 200},
		"key only, no name":     {map[string]string{"X-Metadata-": "dropped"}, 200},
		"printable punctuation": {map[string]string{"X-Metadata-A.b_c~d": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"}, 200},
	} {
		p := "bound-" + strings.ReplaceAll(name, " ", "-")
		code, got := e.uploadMD(p, "x", c.hdr)
		_, statErr := os.Stat(filepath.Join(e.home, p))
		if code != c.want {
			t.Errorf("%s: %d, want %d", name, code, c.want)
		}
		if c.want != 200 && !os.IsNotExist(statErr) {
			t.Errorf("%s: refused, yet the file was written: %v", name, statErr)
		}
		if c.want == 200 {
			if en, err := e.stat(p); err != nil || !maps.Equal(en.GetMetadata(), got[0].Metadata) {
				t.Errorf("%s: stat %v %v, upload said %v", name, en.GetMetadata(), err, got[0].Metadata)
			}
		}
	}
	e.checkNoTemps()
}

// TestFilesMetadataHostile: metadata is read as the requesting user, never
// through a symlink, bounded whatever was set from inside, and an upload
// to a file system that cannot keep it is refused whole rather than
// losing it.
func TestFilesMetadataHostile(t *testing.T) {
	e := newFSEnv(t)
	// A file the user may not read: its metadata is not the user's to see.
	secret := filepath.Join(e.root, "secret")
	e.mustWrite(secret, "s")
	os.Chmod(secret, 0o600)
	if err := unix.Setxattr(secret, "user.e2b.key", []byte("root-only"), 0); err != nil {
		t.Fatal(err)
	}
	if en, err := e.stat("/secret"); err != nil || en.GetMetadata() != nil {
		t.Errorf("user's stat of a root-only file: %v %v, want no metadata", en.GetMetadata(), err)
	}
	// A symlink to it, or to a file of the user's with metadata: shown
	// as the link, not followed.
	if code, _ := e.uploadMD("mine", "m", map[string]string{"X-Metadata-A": "1"}); code != 200 {
		t.Fatal(code)
	}
	e.symlink("/home/user/mine", "home/user/link")
	e.symlink("/secret", "home/user/slink")
	for _, p := range []string{"link", "slink"} {
		if en, err := e.stat(p); err != nil || en.GetMetadata() != nil || en.GetType() != pb.FileType_FILE_TYPE_SYMLINK {
			t.Errorf("stat %s: %v %v, want a symlink without metadata", p, en, err)
		}
	}
	// Set from inside: a value that is not UTF-8 is left out, the rest
	// is shown.
	mine := filepath.Join(e.home, "mine")
	if err := unix.Setxattr(mine, "user.e2b.bin", []byte{0xff, 0xfe}, 0); err != nil {
		t.Fatal(err)
	}
	if en, err := e.stat("mine"); err != nil || !maps.Equal(en.GetMetadata(), map[string]string{"a": "1"}) {
		t.Errorf("stat with a non-UTF-8 value set from inside: %v %v", en.GetMetadata(), err)
	}
	// A file system without user xattrs (ramfs): the upload with
	// metadata is refused and writes nothing; without, it works.
	dir := filepath.Join(e.home, "ramfs")
	os.Mkdir(dir, 0o755)
	if err := unix.Mount("ramfs", dir, "ramfs", 0, "mode=0777"); err != nil {
		t.Skipf("mount ramfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	code, _ := e.uploadMD("ramfs/f", "x", map[string]string{"X-Metadata-A": "1"})
	if _, err := os.Lstat(filepath.Join(dir, "f")); code != http.StatusNotImplemented || !os.IsNotExist(err) {
		t.Errorf("upload with metadata to ramfs: %d (want 501), file: %v (want none)", code, err)
	}
	if code, _ := e.uploadMD("ramfs/g", "x", nil); code != 200 {
		t.Errorf("upload without metadata to ramfs: %d", code)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("ramfs holds %v, want g alone (no temporary file left)", ents)
	}
	// More than the budget, set from inside on a tmpfs (which takes it,
	// where ext4 stops at a block): at most 4096 bytes come back.
	tmp := filepath.Join(e.home, "tmpfs")
	os.Mkdir(tmp, 0o755)
	if err := unix.Mount("tmpfs", tmp, "tmpfs", 0, "mode=0777"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(tmp, unix.MNT_DETACH) })
	e.mustWrite(filepath.Join(tmp, "big"), "x")
	for i := 0; i < 5; i++ {
		if err := unix.Setxattr(filepath.Join(tmp, "big"), "user.e2b.big"+string(rune('0'+i)), bytes.Repeat([]byte("b"), 1800), 0); err != nil {
			t.Skipf("tmpfs here keeps no 9 KB of user xattrs: %v", err)
		}
	}
	en, err := e.stat("tmpfs/big")
	total := 0
	for k, v := range en.GetMetadata() {
		total += len(metadataPrefix) + len(k) + len(v)
	}
	if err != nil || total > maxMetadataTotal || len(en.GetMetadata()) != 2 {
		t.Errorf("9 KB of metadata set from inside: %d bytes in %d keys came back (want 2 keys, at most %d bytes), %v",
			total, len(en.GetMetadata()), maxMetadataTotal, err)
	}

}

func unixGetxattr(p, name string) (string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Getxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// BenchmarkListDirMetadata: one ListDir RPC of 1000 files, as user, end to
// end over loopback HTTP; "plain" files have no attributes (what reading
// metadata costs every listing: one llistxattr per entry), "metadata" files
// carry two keys each (what a listing of uploads with metadata costs).
func BenchmarkListDirMetadata(b *testing.B) {
	for _, withMD := range []bool{false, true} {
		name := "plain"
		if withMD {
			name = "metadata"
		}
		b.Run(name, func(b *testing.B) {
			e := newFSEnv(b)
			dir := filepath.Join(e.home, "many")
			for i := 0; i < 1000; i++ {
				p := filepath.Join(dir, "f"+strconv.Itoa(i))
				e.mustWrite(p, "x")
				if withMD {
					unix.Setxattr(p, "user.e2b.owner", []byte("alice"), 0)
					unix.Setxattr(p, "user.e2b.purpose", []byte("benchmark"), 0)
				}
			}
			ctx := context.Background()
			for b.Loop() {
				res, err := e.c().ListDir(ctx, connect.NewRequest(&pb.ListDirRequest{Path: "many", Depth: 1}))
				if err != nil || len(res.Msg.GetEntries()) != 1000 || (withMD && len(res.Msg.GetEntries()[0].GetMetadata()) != 2) {
					b.Fatalf("list: %v", err)
				}
			}
		})
	}
}

// TestFilesMetadataProcFallback runs the metadata tests through the path
// taken where the kernel lacks listxattrat and getxattrat (gVisor, Linux
// before 6.13): the entry named under /proc/self/fd/N of its directory.
func TestFilesMetadataProcFallback(t *testing.T) {
	xattrAtMissing.Store(true)
	defer xattrAtMissing.Store(false)
	t.Run("metadata", TestFilesMetadata)
	t.Run("hostile", TestFilesMetadataHostile)
	if !xattrAtMissing.Load() {
		t.Fatal("the fallback was left")
	}
}
