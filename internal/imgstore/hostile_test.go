package imgstore

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"
)

// canary is a host file an archive must never reach.
type canary struct{ dir, file string }

func newCanary(t *testing.T) canary {
	t.Helper()
	dir := t.TempDir()
	c := canary{dir: dir, file: filepath.Join(dir, "passwd")}
	if err := os.WriteFile(c.file, []byte("canary"), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// check: the canary file is untouched, not linked, and alone in its dir.
func (c canary) check(t *testing.T) {
	t.Helper()
	if got := readFile(t, c.file); got != "canary" {
		t.Errorf("canary overwritten: %q", got)
	}
	if st := lstat(t, c.file); st.Nlink != 1 {
		t.Errorf("canary has %d links", st.Nlink)
	}
	es, _ := os.ReadDir(c.dir)
	if len(es) != 1 {
		t.Errorf("canary dir has %d entries, want 1", len(es))
	}
}

// noLeftovers: a failed import leaves no layer, record or stage behind.
func noLeftovers(t *testing.T, s *Store) {
	t.Helper()
	if es := layerEntries(t, s); len(es) != 0 {
		t.Errorf("layers dir after a failed import: %q", es)
	}
}

func wantInvalid(t *testing.T, err error, substr string) {
	t.Helper()
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
	if !strings.Contains(err.Error(), substr) {
		t.Errorf("err = %q, want it to mention %q", err, substr)
	}
	if strings.Contains(err.Error(), "\n") {
		t.Errorf("err is not one line: %q", err)
	}
}

func TestHostileArchives(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()

	t.Run("dotdot", func(t *testing.T) {
		s := openStore(t)
		_, err := importRaw(t, s, Options{}, newLayer(t).file("../evil", "x", 0o644).bytes())
		wantInvalid(t, err, `"../evil" escapes the layer`)
		noLeftovers(t, s)
		filepath.WalkDir(filepath.Dir(s.Dir()), func(p string, d fs.DirEntry, err error) error {
			if d != nil && d.Name() == "evil" {
				t.Errorf("%s written", p)
			}
			return nil
		})
	})

	t.Run("absolute", func(t *testing.T) {
		s := openStore(t)
		tm, err := importRaw(t, s, Options{}, newLayer(t).file("/etc/x", "inside", 0o644).bytes())
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		if got := readFile(t, filepath.Join(dirs[0], "etc/x")); got != "inside" {
			t.Errorf("etc/x = %q", got)
		}
	})

	// Symlinks planted by an earlier entry, then written through: refused,
	// the canary untouched, nothing left in the store. The later ones
	// replace a directory the unpacker has already checked (on the path of
	// the entries just before) with a symlink or a file.
	for _, tc := range []struct {
		name  string
		build func(l *layer, c canary)
	}{
		{"symlink-abs-then-file", func(l *layer, c canary) {
			l.symlink("evil", c.dir).file("evil/passwd", "pwned", 0o644)
		}},
		{"symlink-rel-then-file", func(l *layer, c canary) {
			l.symlink("evil", "../../../../../../../../../.."+c.dir).file("evil/passwd", "pwned", 0o644)
		}},
		{"symlink-then-dir", func(l *layer, c canary) {
			l.symlink("evil", c.dir).dir("evil/sub/", 0o755)
		}},
		{"symlink-then-nested-file", func(l *layer, c canary) {
			l.symlink("evil", c.dir).file("evil/sub/passwd", "pwned", 0o644)
		}},
		{"checked-dir-replaced-by-symlink", func(l *layer, c canary) {
			l.dir("d/", 0o755).file("d/x", "x", 0o644).symlink("d", c.dir).file("d/passwd", "pwned", 0o644)
		}},
		{"checked-parent-replaced-by-symlink", func(l *layer, c canary) {
			l.dir("a/", 0o755).dir("a/b/", 0o755).dir("a/b/c/", 0o755).file("a/b/c/x", "x", 0o644).
				symlink("a/b", c.dir).file("a/b/c/passwd", "pwned", 0o644)
		}},
		// A whiteout or an opaque marker aimed through a symlink: the
		// whiteout would remove the canary and make a device in its place,
		// the marker set trusted.overlay.opaque on the host's directory.
		{"whiteout-under-symlink", func(l *layer, c canary) {
			l.symlink("evil", c.dir).file("evil/.wh.passwd", "", 0o644)
		}},
		{"opaque-under-symlink", func(l *layer, c canary) {
			l.symlink("evil", c.dir).file("evil/.wh..wh..opq", "", 0o644)
		}},
		{"whiteout-under-replaced-dir", func(l *layer, c canary) {
			l.dir("d/", 0o755).file("d/x", "x", 0o644).symlink("d", c.dir).file("d/.wh.passwd", "", 0o644)
		}},
		{"checked-parent-replaced-by-file", func(l *layer, c canary) {
			l.dir("a/b/", 0o755).file("a/b/x", "x", 0o644).file("a", "now a file", 0o644).file("a/b/y", "y", 0o644)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCanary(t)
			s := openStore(t)
			l := newLayer(t)
			tc.build(l, c)
			_, err := importRaw(t, s, Options{}, l.bytes())
			c.check(t)
			if err == nil {
				t.Fatalf("import succeeded: the entry under a symlink (or file) the layer planted must be refused")
			}
			wantInvalid(t, err, "not a directory")
			noLeftovers(t, s)
			if _, err := getxattr(c.dir, "trusted.overlay.opaque"); !errors.Is(err, unix.ENODATA) {
				t.Errorf("the canary's directory was marked opaque: %v", err)
			}
		})
	}

	t.Run("file-replaces-symlink", func(t *testing.T) {
		// A later entry of the same name as a symlink to the canary: the
		// symlink is replaced, never written through.
		c := newCanary(t)
		s := openStore(t)
		l := newLayer(t).symlink("p", c.file).file("p", "inside", 0o644).
			symlink("q", c.file).hardlink("q", "p")
		tm, err := importRaw(t, s, Options{}, l.bytes())
		c.check(t)
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		for _, n := range []string{"p", "q"} {
			if st := lstat(t, filepath.Join(dirs[0], n)); st.Mode&unix.S_IFMT != unix.S_IFREG {
				t.Errorf("%s: mode %o, want the layer's regular file", n, st.Mode)
			}
			if got := readFile(t, filepath.Join(dirs[0], n)); got != "inside" {
				t.Errorf("%s = %q", n, got)
			}
		}
	})

	t.Run("file-caps-and-setuid", func(t *testing.T) {
		// A setuid root file keeps its mode (it is root's inside the
		// sandbox only); a file capability is never set on the host.
		s := openStore(t)
		l := newLayer(t).add(tar.Header{Name: "su", Typeflag: tar.TypeReg, Mode: 0o4755, PAXRecords: map[string]string{
			"SCHILY.xattr.security.capability": "\x01\x00\x00\x02\xff\xff\xff\xff\x00\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00",
		}}, "x")
		tm, err := importRaw(t, s, Options{}, l.bytes())
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		p := filepath.Join(dirs[0], "su")
		if st := lstat(t, p); st.Mode&0o7777 != 0o4755 || st.Uid != 0 {
			t.Errorf("su: mode %o uid %d, want 4755 root's", st.Mode&0o7777, st.Uid)
		}
		if _, err := getxattr(p, "security.capability"); !errors.Is(err, unix.ENODATA) {
			t.Errorf("su has a file capability: %v", err)
		}
	})

	for _, tc := range []struct{ name, target, want string }{
		{"hardlink-abs-outside", "@/passwd", "not an earlier file"},
		{"hardlink-dotdot", "../../../../../../../../..@/passwd", "points outside the layer"},
		{"hardlink-missing", "nothere", "not an earlier file"},
		{"hardlink-through-symlink", "s/passwd", "not an earlier file"},
		{"hardlink-to-directory", "d", "not an earlier file"},
		{"hardlink-to-whiteout", "d/gone", "not an earlier file"},
		{"hardlink-through-replaced-dir", "r/f", "not an earlier file"},
		{"hardlink-to-itself", "h", "points to itself"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCanary(t)
			s := openStore(t)
			// s: a symlink to the canary's directory; d: a directory with a
			// whiteout; r: a directory holding f, then replaced by a symlink
			// to the canary's directory.
			l := newLayer(t).symlink("s", c.dir).dir("d/", 0o755).file("d/.wh.gone", "", 0o644).
				dir("r/", 0o755).file("r/f", "f", 0o644).symlink("r", c.dir).
				hardlink("h", strings.ReplaceAll(tc.target, "@", c.dir))
			_, err := importRaw(t, s, Options{}, l.bytes())
			wantInvalid(t, err, tc.want)
			c.check(t)
			noLeftovers(t, s)
		})
	}

	t.Run("hardlink-to-file-replaced-by-symlink", func(t *testing.T) {
		// f is made, then replaced by a symlink to the canary: a link to
		// f links the symlink itself, never what it points to.
		c := newCanary(t)
		s := openStore(t)
		l := newLayer(t).file("f", "f", 0o644).symlink("f", c.file).hardlink("h", "f")
		tm, err := importRaw(t, s, Options{}, l.bytes())
		c.check(t)
		if err != nil {
			t.Fatalf("import: %v (a hard link to an earlier symlink of the layer is allowed)", err)
		}
		dirs, _ := s.LayerDirs(tm)
		st := lstat(t, filepath.Join(dirs[0], "h"))
		if st.Mode&unix.S_IFMT != unix.S_IFLNK || st.Nlink != 2 {
			t.Errorf("h is not a second link of the symlink f: mode %o, %d links", st.Mode, st.Nlink)
		}
		if target, err := os.Readlink(filepath.Join(dirs[0], "h")); err != nil || target != c.file {
			t.Errorf("h -> %q, %v; want the symlink's target %s, stored as it is", target, err, c.file)
		}
	})

	t.Run("hardlink-to-earlier-file", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).file("d/f", "shared", 0o644).hardlink("e/h", "d/f")
		tm, err := importRaw(t, s, Options{}, l.bytes())
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		a, b := lstat(t, filepath.Join(dirs[0], "d/f")), lstat(t, filepath.Join(dirs[0], "e/h"))
		if a.Ino != b.Ino || a.Nlink != 2 {
			t.Errorf("e/h is not a link of d/f: inodes %d and %d, %d links", a.Ino, b.Ino, a.Nlink)
		}
	})

	t.Run("devices-and-fifos", func(t *testing.T) {
		s := openStore(t)
		var p progressLog
		l := newLayer(t).
			add(tar.Header{Name: "dev/sda", Typeflag: tar.TypeBlock, Mode: 0o660, Devmajor: 8}, "").
			add(tar.Header{Name: "dev/mem", Typeflag: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 1}, "").
			add(tar.Header{Name: "fifo", Typeflag: tar.TypeFifo, Mode: 0o666}, "").
			file("ok", "ok", 0o644)
		tm, err := importRaw(t, s, Options{Progress: p.f}, l.bytes())
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		for _, n := range []string{"dev/sda", "dev/mem", "fifo"} {
			if _, err := os.Lstat(filepath.Join(dirs[0], n)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s was made: %v", n, err)
			}
		}
		if p.count("skipped 3") != 1 {
			t.Errorf("progress %q: want a note of 3 skipped entries", p.lines)
		}
	})

	t.Run("uid-out-of-range", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).add(tar.Header{Name: "f", Typeflag: tar.TypeReg, Mode: 0o644, Uid: 70000}, "x")
		_, err := importRaw(t, s, Options{}, l.bytes())
		wantInvalid(t, err, "70000")
		noLeftovers(t, s)
	})

	t.Run("gzip-bomb", func(t *testing.T) {
		s := openStore(t)
		// A base layer that unpacks fine, then 64 MiB of zeros in ~64 KiB.
		base := newLayer(t).file("base", "base", 0o644).bytes()
		var gz bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&gz, gzip.BestCompression)
		h := sha256.New()
		tw := tar.NewWriter(io.MultiWriter(zw, h))
		tw.WriteHeader(&tar.Header{Name: "zeros", Typeflag: tar.TypeReg, Mode: 0o644, Size: 64 << 20})
		zero := make([]byte, 1<<20)
		for range 64 {
			tw.Write(zero)
		}
		tw.Close()
		zw.Close()
		cfg := configFor(t, diffID(base), "sha256:"+hex.EncodeToString(h.Sum(nil)))
		p := rawArchive(t, cfg, base, gz.Bytes())
		_, err := s.Import(ctx, p, "bomb", Options{MaxBytes: 8 << 20})
		wantInvalid(t, err, "image exceeds 8388608 bytes uncompressed")
		noLeftovers(t, s)
	})

	t.Run("implicit-directories-count", func(t *testing.T) {
		// One entry whose name makes 8 directories the archive never
		// listed: each is an entry made, and counts against MaxFiles.
		s := openStore(t)
		l := newLayer(t).file("a/b/c/d/e/f/g/h/file", "x", 0o644)
		_, err := importRaw(t, s, Options{MaxFiles: 5}, l.bytes())
		wantInvalid(t, err, "image exceeds 5 files")
		noLeftovers(t, s)
	})

	t.Run("too-many-files", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t)
		for i := range 20 {
			l.file(strings.Repeat("f", i+1), "x", 0o644)
		}
		_, err := importRaw(t, s, Options{MaxFiles: 10}, l.bytes())
		wantInvalid(t, err, "image exceeds 10 files")
		noLeftovers(t, s)
	})

	t.Run("diffid-mismatch", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).file("f", "real", 0o644).bytes()
		other := newLayer(t).file("f", "claimed", 0o644).bytes()
		_, err := s.Import(ctx, rawArchive(t, configFor(t, diffID(other)), l), "x", Options{})
		wantInvalid(t, err, "does not match its diff ID")
		noLeftovers(t, s)
	})

	t.Run("smuggled-overlay-xattrs", func(t *testing.T) {
		s := openStore(t)
		var p progressLog
		l := newLayer(t).
			add(tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755, PAXRecords: map[string]string{
				"SCHILY.xattr.trusted.overlay.opaque": "y",
				"SCHILY.xattr.user.overlay.opaque":    "y",
			}}, "").
			add(tar.Header{Name: "d/f", Typeflag: tar.TypeReg, Mode: 0o644, PAXRecords: map[string]string{
				"SCHILY.xattr.trusted.overlay.redirect": "/etc",
			}}, "f")
		tm, err := importRaw(t, s, Options{Progress: p.f}, l.bytes())
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		for _, x := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
			if _, err := getxattr(filepath.Join(dirs[0], "d"), x); !errors.Is(err, unix.ENODATA) {
				t.Errorf("d has %s: %v", x, err)
			}
		}
		if _, err := getxattr(filepath.Join(dirs[0], "d/f"), "trusted.overlay.redirect"); !errors.Is(err, unix.ENODATA) {
			t.Errorf("d/f has trusted.overlay.redirect: %v", err)
		}
		if p.count("dropped 3 xattr") != 1 {
			t.Errorf("progress %q: want one note of 3 dropped xattrs", p.lines)
		}
	})

	t.Run("symlink-target-too-long", func(t *testing.T) {
		// Linux takes at most 4,095 bytes; a PAX header carries up to 1 MiB.
		s := openStore(t)
		_, err := importRaw(t, s, Options{}, newLayer(t).symlink("s", strings.Repeat("a/", 4000)).bytes())
		wantInvalid(t, err, "symlink \"s\" has a target of 8000 bytes")
		noLeftovers(t, s)
	})

	t.Run("bad-whiteout", func(t *testing.T) {
		s := openStore(t)
		_, err := importRaw(t, s, Options{}, newLayer(t).file("d/.wh..wh.plnk", "", 0o644).bytes())
		wantInvalid(t, err, "not a valid whiteout")
		noLeftovers(t, s)
	})

	t.Run("truncated-tar", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).file("f", strings.Repeat("x", 4096), 0o644).bytes()
		_, err := importRaw(t, s, Options{}, l[:1500])
		wantInvalid(t, err, "bad tar")
		noLeftovers(t, s)
	})

	t.Run("oci-blob-digest-mismatch", func(t *testing.T) {
		// The same layer recompressed: its diff ID still holds, the
		// digest the manifest names does not.
		s := openStore(t)
		l := newLayer(t).file("f", strings.Repeat("f", 1000), 0o644).bytes()
		img := buildImage(t, v1.Config{}, [][]byte{l})
		dir := writeOCIDir(t, img, "latest")
		layers, _ := img.Layers()
		d, _ := layers[0].Digest()
		var gz bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&gz, gzip.NoCompression)
		zw.Write(l)
		zw.Close()
		if err := os.WriteFile(filepath.Join(dir, "blobs/sha256", d.Hex), gz.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := s.Import(ctx, dir, "x", Options{})
		wantInvalid(t, err, "does not match its digest")
		noLeftovers(t, s)
	})

	t.Run("too-many-layers", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).bytes()
		var ls [][]byte
		for range maxLayers + 1 {
			ls = append(ls, l)
		}
		_, err := importRaw(t, s, Options{}, ls...)
		wantInvalid(t, err, "overlayfs stacks at most")
	})

	t.Run("wrong-platform", func(t *testing.T) {
		s := openStore(t)
		l := newLayer(t).file("f", "f", 0o644).bytes()
		cfg := configFor(t, diffID(l))
		cfg.Architecture = "arm64"
		_, err := s.Import(ctx, rawArchive(t, cfg, l), "arm", Options{})
		wantInvalid(t, err, "linux/arm64")
	})

	t.Run("names", func(t *testing.T) {
		s := openStore(t)
		p := rawArchive(t, configFor(t, diffID(newLayer(t).bytes())), newLayer(t).bytes())
		for _, n := range []string{"../x", "host", "", "UPPER", "a/b", "a..b", "x:tag", strings.Repeat("a", 64)} {
			if _, err := s.Import(ctx, p, n, Options{}); !errors.Is(err, ErrInvalid) {
				t.Errorf("Import as %q: %v, want ErrInvalid", n, err)
			}
		}
		if _, err := s.Get("../x"); !errors.Is(err, ErrInvalid) {
			t.Errorf("Get(../x) = %v", err)
		}
	})
}

// paxRecord is one "len key=value\n" record of a PAX header.
func paxRecord(k, v string) string {
	rec := " " + k + "=" + v + "\n"
	n := len(rec)
	for len(fmt.Sprint(n))+len(rec) != n {
		n = len(fmt.Sprint(n)) + len(rec)
	}
	return fmt.Sprint(n) + rec
}

// ustarBlock is a bare ustar header block.
func ustarBlock(name string, typeflag byte, size int64) []byte {
	b := make([]byte, 512)
	copy(b[0:], name)
	copy(b[100:], "0000644\x00")
	copy(b[108:], "0000000\x00")
	copy(b[116:], "0000000\x00")
	copy(b[124:], fmt.Sprintf("%011o\x00", size))
	copy(b[136:], fmt.Sprintf("%011o\x00", testTime.Unix()))
	b[156] = typeflag
	copy(b[257:], "ustar\x0000")
	copy(b[148:], "        ")
	sum := 0
	for _, c := range b {
		sum += int(c)
	}
	copy(b[148:], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

func pad512(b []byte) []byte {
	return append(b, make([]byte, (512-len(b)%512)%512)...)
}

// sparseLayer is a layer of one GNU sparse (PAX 1.0) file of realsize bytes
// holding "hello" at offset 4096, which archive/tar can read but not write.
func sparseLayer(realsize int64) []byte {
	pax := paxRecord("GNU.sparse.major", "1") + paxRecord("GNU.sparse.minor", "0") +
		paxRecord("GNU.sparse.name", "sparse") + paxRecord("GNU.sparse.realsize", fmt.Sprint(realsize))
	var out []byte
	out = append(out, ustarBlock("PaxHeaders/sparse", 'x', int64(len(pax)))...)
	out = append(out, pad512([]byte(pax))...)
	data := append(pad512([]byte("1\n4096\n5\n")), "hello"...)
	out = append(out, ustarBlock("GNUSparseFile.0/sparse", '0', int64(len(data)))...)
	out = append(out, pad512(data)...)
	return append(out, make([]byte, 1024)...)
}

func TestSparseFiles(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()

	t.Run("unpacked-and-exported-exactly", func(t *testing.T) {
		s := openStore(t)
		l := sparseLayer(1 << 20)
		tm, err := importRaw(t, s, Options{}, l)
		if err != nil {
			t.Fatal(err)
		}
		dirs, _ := s.LayerDirs(tm)
		b, err := os.ReadFile(filepath.Join(dirs[0], "sparse"))
		if err != nil || len(b) != 1<<20 || string(b[4096:4101]) != "hello" || bytes.Count(b, []byte{0}) != 1<<20-5 {
			t.Fatalf("sparse file: %d bytes, %v", len(b), err)
		}
		var out bytes.Buffer
		if err := s.Export(ctx, tm.Name, &out); err != nil {
			t.Fatal(err)
		}
		if got := tarFiles(t, out.Bytes())[tm.Layers[0][7:]+"/layer.tar"]; !bytes.Equal(got, l) {
			t.Errorf("exported sparse layer differs from the original (%d vs %d bytes)", len(got), len(l))
		}
	})

	t.Run("bomb", func(t *testing.T) {
		// A few KiB of archive that would write 64 MiB of holes.
		s := openStore(t)
		_, err := importRaw(t, s, Options{MaxBytes: 8 << 20}, sparseLayer(64<<20))
		wantInvalid(t, err, "image exceeds 8388608 bytes uncompressed")
		noLeftovers(t, s)
	})
}

func TestImportCanceled(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	l := newLayer(t).file("f", "f", 0o644).bytes()
	_, err := s.Import(ctx, rawArchive(t, configFor(t, diffID(l)), l), "x", Options{})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Import with a canceled context = %v", err)
	}
	noLeftovers(t, s)
}

// Attack: whoever may write an OCI layout's directory swaps a blob for a
// FIFO after the importer has looked at it. Expected: the import fails at
// once, naming the blob; before, root's open of the FIFO blocked for good.
func TestImportBlobSwappedForFIFO(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	l := newLayer(t).file("f", "f", 0o644).bytes()
	img := buildImage(t, v1.Config{}, [][]byte{l})
	dir := writeOCIDir(t, img, "latest")
	layers, _ := img.Layers()
	d, _ := layers[0].Digest()
	blob := "blobs/sha256/" + d.Hex
	testHookBeforeOpen = func(name string) {
		if name != blob {
			return
		}
		fifo := filepath.Join(dir, "fifo")
		if err := unix.Mkfifo(fifo, 0o644); err != nil {
			t.Error(err)
		}
		if err := os.Rename(fifo, filepath.Join(dir, blob)); err != nil {
			t.Error(err)
		}
	}
	defer func() { testHookBeforeOpen = nil }()
	done := make(chan error, 1)
	go func() {
		_, err := s.Import(context.Background(), dir, "x", Options{})
		done <- err
	}()
	select {
	case err := <-done:
		wantInvalid(t, err, "not a regular file")
		noLeftovers(t, s)
	case <-time.After(10 * time.Second):
		// Let the blocked open go before the test's directory is removed.
		if f, err := os.OpenFile(filepath.Join(dir, blob), os.O_WRONLY, 0); err == nil {
			f.Close()
		}
		t.Fatal("the import blocked on a FIFO swapped in for its layer blob")
	}
}

// zstdLayer compresses l with zstd, declaring a window of window bytes.
func zstdLayer(t *testing.T, l []byte, window int) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := zstd.NewWriter(&buf, zstd.WithWindowSize(window), zstd.WithSingleSegment(false), zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := zw.Write(l); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Attack: a zstd layer declaring a 512 MiB window, which its decoder keeps
// as history: 67 KB of zstd holding 600 MiB of zeros took the importer 513
// MiB. Expected: a window past zstd's own default limit (128 MiB) is
// refused in one line before anything is unpacked; an 8 MiB one (zstd's
// usual) imports.
func TestZstdWindowBounded(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	l := newLayer(t).file("f", "f", 0o644).file("zeros", strings.Repeat("\x00", 1<<20), 0o644).bytes()
	s := openStore(t)
	_, err := s.Import(ctx, rawArchive(t, configFor(t, diffID(l)), zstdLayer(t, l, 512<<20)), "big", Options{})
	wantInvalid(t, err, "window")
	noLeftovers(t, s)
	tm, err := s.Import(ctx, rawArchive(t, configFor(t, diffID(l)), zstdLayer(t, l, 8<<20)), "usual", Options{})
	if err != nil {
		t.Fatalf("a zstd layer of an 8 MiB window: %v", err)
	}
	dirs, _ := s.LayerDirs(tm)
	if got := readFile(t, filepath.Join(dirs[0], "f")); got != "f" {
		t.Errorf("f = %q", got)
	}
}
