package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"
)

// exportLayers: every kind of entry, dropped ones included, in an order
// and format no fresh tar writer would reproduce (unsorted, absolute and
// long names, GNU-style padding to a 10 KiB record).
func exportLayers(t *testing.T) [][]byte {
	l1 := newLayer(t).
		dir("./", 0o755).
		file("zz-last-first", "z", 0o600).
		dir("/usr/", 0o755).
		dir("usr/bin/", 0o755).
		add(tar.Header{Name: "usr/bin/sudo", Typeflag: tar.TypeReg, Mode: 0o4711, Uid: 0, Gid: 0}, "sudo").
		add(tar.Header{Name: "home/user/.profile", Typeflag: tar.TypeReg, Mode: 0o644, Uid: 1000, Gid: 1000, PAXRecords: map[string]string{
			"SCHILY.xattr.user.mime":          "text/plain",
			"SCHILY.xattr.security.selinux":   "unconfined_u",
			"SCHILY.xattr.trusted.overlay.x":  "y",
			"SCHILY.xattr.system.posix_acl_a": "acl",
		}}, "export PS1='$ '\n").
		file("usr/"+strings.Repeat("long-name-", 20), "long", 0o644).
		symlink("usr/bin/python", "python3.12").
		file("usr/bin/python3.12", strings.Repeat("py", 5000), 0o755).
		hardlink("usr/bin/python3", "usr/bin/python3.12").
		add(tar.Header{Name: "dev/null", Typeflag: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3}, "").
		add(tar.Header{Name: "run/fifo", Typeflag: tar.TypeFifo, Mode: 0o600}, "").
		file("empty", "", 0o644).
		dir("opt/app/", 0o700).
		file("opt/app/a", "a", 0o644).
		bytes()
	l1 = append(l1, make([]byte, 10240-len(l1)%10240)...)
	l2 := newLayer(t).
		file("usr/bin/.wh.sudo", "", 0).
		file("opt/app/.wh..wh..opq", "", 0).
		file("opt/app/b", "b", 0o644).
		bytes()
	return [][]byte{l1, l2}
}

func TestExportRoundTrip(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	layers := exportLayers(t)
	img := buildImage(t, sampleConfig, layers)
	s1 := openStore(t)
	orig, err := s1.Import(ctx, writeDockerSave(t, img, "orig:latest"), "orig", Options{})
	if err != nil {
		t.Fatal(err)
	}

	var out bytes.Buffer
	if err := s1.Export(ctx, "orig", &out); err != nil {
		t.Fatal(err)
	}
	// The layer tars in the export are the original ones, byte for byte.
	files := tarFiles(t, out.Bytes())
	for i, l := range layers {
		p := strings.TrimPrefix(diffID(l), "sha256:") + "/layer.tar"
		if !bytes.Equal(files[p], l) {
			t.Errorf("layer %d in the export differs from the original (%d vs %d bytes)", i+1, len(files[p]), len(l))
		}
	}
	if !strings.Contains(string(files["manifest.json"]), `"orig:latest"`) {
		t.Errorf("manifest.json = %s", files["manifest.json"])
	}

	p := filepath.Join(t.TempDir(), "export.tar")
	if err := os.WriteFile(p, out.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t)
	back, err := s2.Import(ctx, p, "orig", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if back.ID != orig.ID || !reflect.DeepEqual(back.Layers, orig.Layers) || !reflect.DeepEqual(back.Config, orig.Config) || back.Size != orig.Size {
		t.Errorf("round trip changed the template:\n got %+v\nwant %+v", back, orig)
	}
	d1, _ := s1.LayerDirs(orig)
	d2, _ := s2.LayerDirs(back)
	for i := range d1 {
		if a, b := describeTree(t, d1[i]), describeTree(t, d2[i]); !reflect.DeepEqual(a, b) {
			t.Errorf("layer %d differs after the round trip:\n%s\nvs\n%s", i+1, strings.Join(a, "\n"), strings.Join(b, "\n"))
		}
	}

	// A layer changed behind the store's back is not exported as if whole.
	if err := os.WriteFile(filepath.Join(d1[0], "usr/bin/python3.12"), []byte("changed"), 0o755); err != nil {
		t.Fatal(err)
	}
	err = s1.Export(ctx, "orig", io.Discard)
	if err == nil || !strings.Contains(err.Error(), "changed since import") {
		t.Errorf("Export of a modified layer = %v", err)
	}
	if err := s1.Export(ctx, "nothing", io.Discard); !errors.Is(err, ErrNotFound) {
		t.Errorf("Export(nothing) = %v", err)
	}
}

func tarFiles(t *testing.T, b []byte) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = data
	}
}

// describeTree is one line per entry: type, mode, owner, size, times,
// device, link target, xattrs, link count, and a digest of the contents.
func describeTree(t *testing.T, root string) []string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s mode=%o owner=%d:%d size=%d mtime=%d rdev=%d nlink=%d", rel, st.Mode, st.Uid, st.Gid, st.Size, st.Mtim.Sec, st.Rdev, st.Nlink)
		if d.IsDir() {
			// Not the mtime: directories the archive did not list are
			// made when unpacked.
			line = fmt.Sprintf("%s mode=%o owner=%d:%d", rel, st.Mode, st.Uid, st.Gid)
		}
		if d.Type()&fs.ModeSymlink != 0 {
			target, _ := os.Readlink(p)
			line += " -> " + target
		} else if d.Type().IsRegular() {
			b, _ := os.ReadFile(p)
			line += " " + diffID(b)[:19]
		}
		if d.Type()&fs.ModeSymlink == 0 {
			line += " xattrs=" + strings.Join(listXattrs(p), ",")
		}
		lines = append(lines, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return lines
}

func listXattrs(p string) []string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n == 0 {
		return nil
	}
	var out []string
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		v, _ := getxattr(p, name)
		out = append(out, name+"="+v)
	}
	slices.Sort(out)
	return out
}

func TestConcurrentImports(t *testing.T) {
	requireRoot(t)
	base := newLayer(t)
	for i := range 300 {
		base.file(fmt.Sprintf("usr/lib/f%03d", i), strings.Repeat("b", 1000), 0o644)
	}
	baseTar := base.bytes()
	archives := []string{
		writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{baseTar, newLayer(t).file("a", "a", 0o644).bytes()}), "a:latest"),
		writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{baseTar, newLayer(t).file("b", "b", 0o644).bytes()}), "b:latest"),
	}
	s := openStore(t)
	var p progressLog
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, name := range []string{"a", "b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = s.Import(context.Background(), archives[i], name, Options{Progress: p.f})
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := countLayerDirs(t, s); n != 3 {
		t.Errorf("%d layer dirs, want 3", n)
	}
	if n := p.count("layer 1/2 sha256:") - p.count("reused"); n != 1 {
		t.Errorf("base layer unpacked %d times, want once (progress %q)", n, p.lines)
	}
	for _, e := range layerEntries(t, s) {
		if strings.HasPrefix(e, tmpPrefix) {
			t.Errorf("leftover %s", e)
		}
	}
	for _, name := range []string{"a", "b"} {
		tm, err := s.Get(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.LayerDirs(tm); err != nil {
			t.Error(err)
		}
	}
}
