package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestDirectoryTimes: a directory's times are the archive's, however its
// entries come: before or after the directory's own entry, with other
// directories between, or replaced on the way.
func TestDirectoryTimes(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	at := func(h int) time.Time { return testTime.Add(time.Duration(h) * time.Hour) }
	l := newLayer(t).
		add(tar.Header{Name: "a/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: at(1), AccessTime: at(11), Format: tar.FormatPAX}, "").
		add(tar.Header{Name: "b/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: at(2), AccessTime: at(12), Format: tar.FormatPAX}, "").
		file("a/x", "x", 0o644). // back to a, after b
		file("b/y", "y", 0o644).
		file("c/d/z", "z", 0o644). // c and c/d made for it, given their times later
		dir("a/sub/", 0o755).      // a's entry made in a
		file("b/y", "again", 0o644).
		add(tar.Header{Name: "c/d/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: at(4), Format: tar.FormatPAX}, "").
		add(tar.Header{Name: "c/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: at(3), Format: tar.FormatPAX}, "").
		file("c/d/late", "late", 0o644). // into c/d once more, after c's entry
		add(tar.Header{Name: "e/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: at(5), Format: tar.FormatPAX}, "").
		file("e/f", "f", 0o644).
		file("e/f", "replaced", 0o644)
	tm, err := importRaw(t, s, Options{}, l.bytes())
	if err != nil {
		t.Fatal(err)
	}
	dirs, _ := s.LayerDirs(tm)
	for _, c := range []struct {
		name         string
		mtime, atime time.Time
	}{
		{"a", at(1), at(11)}, {"b", at(2), at(12)}, {"c", at(3), at(3)}, {"c/d", at(4), at(4)}, {"e", at(5), at(5)},
		{"a/sub", testTime, testTime},
	} {
		st := lstat(t, filepath.Join(dirs[0], c.name))
		if got := time.Unix(st.Mtim.Unix()); !got.Equal(c.mtime) {
			t.Errorf("%s: mtime %v, want %v", c.name, got.UTC(), c.mtime)
		}
		if got := time.Unix(st.Atim.Unix()); !got.Equal(c.atime) {
			t.Errorf("%s: atime %v, want %v", c.name, got.UTC(), c.atime)
		}
	}
}

// TestSparseHoles: a sparse entry is written with its holes as holes, so a
// mostly empty file of 64 MiB takes a few blocks of the host's disk.
func TestSparseHoles(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	tm, err := importRaw(t, s, Options{}, sparseLayer(64<<20))
	if err != nil {
		t.Fatal(err)
	}
	dirs, _ := s.LayerDirs(tm)
	st := lstat(t, filepath.Join(dirs[0], "sparse"))
	if st.Size != 64<<20 || st.Blocks*512 > 64<<10 {
		t.Errorf("sparse: %d bytes taking %d bytes of disk; want 64 MiB taking at most 64 KiB", st.Size, st.Blocks*512)
	}
	b, _ := os.ReadFile(filepath.Join(dirs[0], "sparse"))
	if len(b) != 64<<20 || string(b[4096:4101]) != "hello" || bytes.Count(b, []byte{0}) != 64<<20-5 {
		t.Errorf("sparse: wrong contents (%d bytes)", len(b))
	}
}

// fuzzSeed is a layer tar of entries given as "TYPE NAME [TARGET|BODY]".
func fuzzSeed(entries ...string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		f := strings.SplitN(e, " ", 3)
		h := &tar.Header{Name: f[1], Mode: 0o644, ModTime: testTime, Format: tar.FormatPAX}
		body := ""
		switch f[0] {
		case "d":
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case "f":
			h.Typeflag, body = tar.TypeReg, f[2]
			h.Size = int64(len(body))
		case "s":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f[2]
		case "h":
			h.Typeflag, h.Linkname = tar.TypeLink, f[2]
		case "p":
			h.Typeflag = tar.TypeFifo
		case "c":
			h.Typeflag, h.Devmajor, h.Devminor = tar.TypeChar, 1, 3
		case "x":
			h.Typeflag, h.PAXRecords = tar.TypeReg, map[string]string{
				"SCHILY.xattr.trusted.overlay.redirect": "/", "SCHILY.xattr.user.ok": "1", "SCHILY.xattr.security.capability": "x"}
		}
		if err := tw.WriteHeader(h); err != nil {
			panic(err)
		}
		io.WriteString(tw, body)
	}
	tw.Close()
	return buf.Bytes()
}

const (
	fuzzMaxBytes = 1 << 20
	fuzzMaxFiles = 64
)

// FuzzUnpack feeds the layer unpacker arbitrary tar streams, beside a
// directory holding a canary, and checks what any stream must leave: no
// panic, one-line errors, nothing made or changed outside the layer's
// directory, at most fuzzMaxFiles entries and fuzzMaxBytes bytes of files
// in it (holes included) whatever the stream claims, and only what a lower
// layer may hold: directories, regular files, symlinks, 0:0 whiteouts, no
// xattr but user.* and trusted.overlay.opaque=y.
func FuzzUnpack(f *testing.F) {
	if os.Geteuid() != 0 {
		f.Skip("needs root (owners)")
	}
	f.Add(fuzzSeed("d etc/", "f etc/passwd root:x:0:0::/root:/bin/sh", "s etc/link passwd", "h etc/hard etc/passwd"))
	f.Add(fuzzSeed("s evil ../outside", "f evil/canary pwned", "d evil/sub/"))
	f.Add(fuzzSeed("d a/b/", "f a/b/x x", "s a ../outside", "f a/b/y y", "h h ../outside/canary"))
	f.Add(fuzzSeed("f ../outside/canary pwned", "f /abs/x x", "h h /outside/canary", "p fifo", "c null"))
	f.Add(fuzzSeed("d d/", "f d/.wh.gone ", "f d/.wh..wh..opq ", "h h d/gone", "x xattrs"))
	f.Add(fuzzSeed("f " + strings.Repeat("n", 255) + "/" + strings.Repeat("m", 255) + "/" + strings.Repeat("o", 3000) + " long"))
	f.Add(fuzzSeed("f " + strings.Repeat("d/", 400) + "deep deep"))
	f.Add(fuzzSeed("f " + strings.Repeat("a/", 80) + "x x"))
	f.Add(sparseLayer(1 << 20))
	f.Add(sparseLayer(1 << 40))
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		outside, layerDir := filepath.Join(dir, "outside"), filepath.Join(dir, "layer")
		for _, d := range []string{outside, layerDir} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(outside, "canary"), []byte("canary"), 0o644); err != nil {
			t.Fatal(err)
		}
		root, err := os.OpenRoot(layerDir)
		if err != nil {
			t.Fatal(err)
		}
		defer root.Close()
		b := &budget{maxBytes: fuzzMaxBytes, maxFiles: fuzzMaxFiles}
		cr := &countingReader{ctx: context.Background(), r: bytes.NewReader(data), b: b}
		rec := &recorder{r: cr, rw: newRecipeWriter(io.Discard)}
		err = newUnpacker(root, "layer", b, rec).run(tar.NewReader(rec))
		if err != nil && strings.Contains(err.Error(), "\n") {
			t.Errorf("error of more than one line: %q", err)
		}
		checkOutside(t, dir, outside)
		checkLayer(t, layerDir)
	})
}

func checkOutside(t *testing.T, dir, outside string) {
	t.Helper()
	if es, _ := os.ReadDir(dir); len(es) != 2 {
		t.Errorf("beside the layer: %v; want only layer and outside", es)
	}
	es, _ := os.ReadDir(outside)
	b, _ := os.ReadFile(filepath.Join(outside, "canary"))
	st := lstat(t, filepath.Join(outside, "canary"))
	if len(es) != 1 || string(b) != "canary" || st.Nlink != 1 {
		t.Errorf("the canary's directory changed: %v, canary %q with %d links", es, b, st.Nlink)
	}
}

func checkLayer(t *testing.T, layerDir string) {
	t.Helper()
	entries, size := 0, int64(0)
	seen := map[uint64]bool{}
	err := filepath.WalkDir(layerDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR, unix.S_IFLNK:
		case unix.S_IFREG:
			if !seen[st.Ino] {
				seen[st.Ino] = true
				size += st.Size
			}
		case unix.S_IFCHR:
			if st.Rdev != 0 {
				t.Errorf("%s: a device %d made", p, st.Rdev)
			}
		default:
			t.Errorf("%s: mode %o made", p, st.Mode)
		}
		if p != layerDir {
			entries++
		}
		checkXattrs(t, p, st.Mode&unix.S_IFMT == unix.S_IFDIR)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if entries > fuzzMaxFiles || size > fuzzMaxBytes {
		t.Errorf("the layer holds %d entries and %d bytes of files, over the bounds %d and %d", entries, size, fuzzMaxFiles, fuzzMaxBytes)
	}
}

func checkXattrs(t *testing.T, p string, isDir bool) {
	t.Helper()
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		return
	}
	for _, x := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		switch {
		case x == "":
		case x == "trusted.overlay.opaque" && isDir:
			if v, _ := getxattr(p, x); v != "y" {
				t.Errorf("%s: %s=%q", p, x, v)
			}
		case strings.HasPrefix(x, "user.") && !strings.HasPrefix(x, "user.overlay."):
		default:
			t.Errorf("%s: xattr %s kept", p, x)
		}
	}
}

// Attack: a layer whose entries alternate between the bottoms of two
// chains of 1,000 directories (a/a/.../f0, b/b/.../f1, ...): each entry
// left the chain the unpacker had checked, and each of the 1,000
// directories it then checked was opened from the layer's root, a path of
// up to 1,000 names (some 7 s of the host's time per entry at a depth of
// 2,000; a 156 KiB gzipped archive, hours). Expected: the layer unpacks
// whole, resolving some depth's worth of names per entry, not its square;
// and an import that would resolve more than maxWalk names is refused.
func TestDeepAlternatingChains(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (owners)")
	}
	const depth, entries = 1000, 40
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range entries {
		dir := strings.Repeat(string(rune('a'+i%2))+"/", depth)
		if err := tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("%sf%d", dir, i), Typeflag: tar.TypeReg, Mode: 0o644, Format: tar.FormatPAX}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	unpack := func(b *budget) error {
		root, err := os.OpenRoot(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		defer root.Close()
		cr := &countingReader{ctx: context.Background(), r: bytes.NewReader(buf.Bytes()), b: b}
		rec := &recorder{r: cr, rw: newRecipeWriter(io.Discard)}
		return newUnpacker(root, "layer", b, rec).run(tar.NewReader(rec))
	}
	b := &budget{maxBytes: 1 << 30, maxFiles: 1 << 20}
	if err := unpack(b); err != nil {
		t.Fatal(err)
	}
	if b.files != 2*depth+entries {
		t.Errorf("%d entries made; want %d", b.files, 2*depth+entries)
	}
	if b.walked > 4*depth*entries {
		t.Errorf("%d names resolved from the root for %d entries %d deep; want at most %d", b.walked, entries, depth, 4*depth*entries)
	}
	t.Logf("%d names resolved from the root", b.walked)
	// Each entry still goes down its whole chain, a name at a time (some
	// 50 ms of the host's time per entry 2,000 deep: a 33 KB gzipped
	// archive of 2,000 such entries took 107 s, and the 2,000,000 entries
	// an import may hold some 30 hours): every one of those names counts.
	if b.walked < depth*entries {
		t.Errorf("%d names charged for %d entries, each going down %d directories; want at least %d", b.walked, entries, depth, depth*entries)
	}
	small := &budget{maxBytes: 1 << 30, maxFiles: 1 << 20, walked: maxWalk - 10}
	if err := unpack(small); err == nil || !strings.Contains(err.Error(), "too deep to unpack") {
		t.Errorf("an import past maxWalk: %v; want refused", err)
	}
	// Room for some ten entries' chains, not forty: refused part way.
	part := &budget{maxBytes: 1 << 30, maxFiles: 1 << 20, walked: maxWalk - 10*depth}
	if err := unpack(part); err == nil || !strings.Contains(err.Error(), "too deep to unpack") {
		t.Errorf("an import whose descents pass maxWalk: %v; want refused", err)
	}
	if part.files >= 2*depth+entries {
		t.Errorf("%d entries made; want it stopped before all %d", part.files, 2*depth+entries)
	}
}
