package cli

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// tarOf builds a tar stream of entries "TYPE NAME [TARGET|BODY]" (d dir, f
// file, F file of mode 04755, s symlink, h hard link, p FIFO, c device).
func tarOf(entries ...string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		f := strings.SplitN(e, " ", 3)
		h := &tar.Header{Name: f[1], Mode: 0o644, Format: tar.FormatPAX}
		body := ""
		switch f[0] {
		case "d":
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case "f", "F":
			h.Typeflag, body = tar.TypeReg, f[2]
			h.Size = int64(len(body))
			if f[0] == "F" {
				h.Mode = 0o6755
			}
		case "s":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f[2]
		case "h":
			h.Typeflag, h.Linkname = tar.TypeLink, f[2]
		case "p":
			h.Typeflag = tar.TypeFifo
		case "c":
			h.Typeflag, h.Devmajor, h.Devminor = tar.TypeChar, 1, 3
		}
		if err := tw.WriteHeader(h); err != nil {
			panic(err)
		}
		tw.Write([]byte(body))
	}
	tw.Close()
	return buf.Bytes()
}

// paxSparse is a tar of one GNU sparse (PAX 1.0) file of realsize bytes
// holding "hello" at offset 4096: a few KiB of archive for any size.
func paxSparse(name string, realsize int64) []byte {
	rec := func(k, v string) string {
		r := " " + k + "=" + v + "\n"
		n := len(r)
		for len(fmt.Sprint(n))+len(r) != n {
			n = len(fmt.Sprint(n)) + len(r)
		}
		return fmt.Sprint(n) + r
	}
	pad := func(b []byte) []byte { return append(b, make([]byte, (512-len(b)%512)%512)...) }
	pax := rec("GNU.sparse.major", "1") + rec("GNU.sparse.minor", "0") + rec("GNU.sparse.name", name) +
		rec("GNU.sparse.realsize", fmt.Sprint(realsize))
	out := append(ustarBlock("PaxHeaders/"+name, 'x', len(pax)), pad([]byte(pax))...)
	data := append(pad([]byte("1\n4096\n5\n")), "hello"...)
	out = append(out, ustarBlock("GNUSparseFile.0/"+name, '0', len(data))...)
	out = append(out, pad(data)...)
	return append(out, make([]byte, 1024)...)
}

// ustarBlock is a bare ustar header block.
func ustarBlock(name string, typ byte, size int) []byte {
	b := make([]byte, 512)
	copy(b, name)
	copy(b[100:], "0000644\x00")
	copy(b[108:], "0000000\x00")
	copy(b[116:], "0000000\x00")
	copy(b[124:], fmt.Sprintf("%011o\x00", size))
	copy(b[136:], "00000000000\x00")
	b[156] = typ
	copy(b[257:], "ustar\x0000")
	copy(b[148:], "        ")
	sum := 0
	for _, c := range b {
		sum += int(c)
	}
	copy(b[148:], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

// untarSetup is a destination beside a directory holding a canary.
type untarSetup struct{ dir, dst, outside string }

func newUntarSetup(t testing.TB) untarSetup {
	t.Helper()
	dir := t.TempDir()
	s := untarSetup{dir: dir, dst: filepath.Join(dir, "dst"), outside: filepath.Join(dir, "outside")}
	for _, d := range []string{s.dst, s.outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(s.outside, "canary"), []byte("canary"), 0o644); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s untarSetup) run(t testing.TB, data []byte, lim cpLimits) error {
	t.Helper()
	root, err := os.OpenRoot(s.dst)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	_, err = untar(root, bytes.NewReader(data), lim)
	return err
}

// untouched checks that nothing outside dst was made or changed.
func (s untarSetup) untouched(t testing.TB) {
	t.Helper()
	if es, _ := os.ReadDir(s.dir); len(es) != 2 {
		t.Errorf("beside the destination: %v", es)
	}
	es, _ := os.ReadDir(s.outside)
	b, _ := os.ReadFile(filepath.Join(s.outside, "canary"))
	var st unix.Stat_t
	_ = unix.Lstat(filepath.Join(s.outside, "canary"), &st)
	if len(es) != 1 || string(b) != "canary" || st.Nlink != 1 {
		t.Errorf("outside the destination: %v, canary %q with %d links", es, b, st.Nlink)
	}
}

var testLimits = cpLimits{MaxBytes: 8 << 20, MaxEntries: 100}

// TestUntarHostile: each archive a hostile sandbox may send, and what the
// host does with it. Nothing ever lands outside the destination.
func TestUntarHostile(t *testing.T) {
	cases := []struct {
		name    string
		archive func(s untarSetup) []byte
		lim     cpLimits
		want    string // substring of the error; "" when the copy is allowed
		check   func(t *testing.T, s untarSetup)
	}{
		{name: "dotdot", archive: func(untarSetup) []byte { return tarOf("f ../outside/canary pwned") }, want: "leaves the destination"},
		{name: "absolute", archive: func(s untarSetup) []byte { return tarOf("f " + s.outside + "/x pwned") }, want: "leaves the destination"},
		{name: "symlink-out-then-write", archive: func(untarSetup) []byte { return tarOf("s evil ../outside", "f evil/canary pwned") },
			want: "not a directory"},
		{name: "symlink-in-then-write", archive: func(untarSetup) []byte { return tarOf("d sub/", "s link sub", "f link/x through") },
			want: "not a directory"},
		{name: "symlink-then-dir", archive: func(untarSetup) []byte { return tarOf("s evil ../outside", "d evil/sub/") }, want: "not a directory"},
		{name: "file-then-symlink", archive: func(untarSetup) []byte { return tarOf("f f ok", "s f ../outside/canary", "f f pwned") },
			want: "already copied"},
		{name: "symlink-then-file", archive: func(untarSetup) []byte { return tarOf("s s ../outside/canary", "f s pwned") }, want: "already copied"},
		{name: "dir-then-symlink", archive: func(untarSetup) []byte { return tarOf("d d/", "s d ../outside", "f d/x pwned") }, want: "already copied"},
		{name: "hardlink-out", archive: func(untarSetup) []byte { return tarOf("h h ../outside/canary") }, want: "leaves the destination"},
		{name: "hardlink-absolute", archive: func(s untarSetup) []byte { return tarOf("h h " + s.outside + "/canary") }, want: "leaves the destination"},
		{name: "hardlink-through-symlink", archive: func(untarSetup) []byte { return tarOf("s s ../outside", "h h s/canary") }, want: "not a file it copied"},
		{name: "hardlink-to-symlink", archive: func(untarSetup) []byte { return tarOf("s s ../outside/canary", "h h s") }, want: "not a file it copied"},
		{name: "hardlink-to-earlier-file", archive: func(untarSetup) []byte { return tarOf("f d/f shared", "h e/h d/f") },
			check: func(t *testing.T, s untarSetup) {
				a, b := statOf(t, filepath.Join(s.dst, "d/f")), statOf(t, filepath.Join(s.dst, "e/h"))
				if a.Ino != b.Ino || a.Nlink != 2 {
					t.Errorf("e/h is not a link of d/f: inodes %d, %d; %d links", a.Ino, b.Ino, a.Nlink)
				}
			}},
		{name: "devices-and-fifos", archive: func(untarSetup) []byte { return tarOf("c null", "p fifo", "f ok ok") },
			check: func(t *testing.T, s untarSetup) {
				if es, _ := os.ReadDir(s.dst); len(es) != 1 || es[0].Name() != "ok" {
					t.Errorf("destination: %v; want only ok (no device, no FIFO)", es)
				}
			}},
		{name: "setuid-dropped", archive: func(untarSetup) []byte { return tarOf("F suid x") },
			check: func(t *testing.T, s untarSetup) {
				if st := statOf(t, filepath.Join(s.dst, "suid")); st.Mode&0o7000 != 0 {
					t.Errorf("suid: mode %o keeps setuid/setgid bits", st.Mode)
				}
			}},
		{name: "top-not-a-directory", archive: func(untarSetup) []byte { return tarOf("f . x") }, want: "top is not a directory"},
		{name: "name-too-long", archive: func(untarSetup) []byte { return tarOf("f " + strings.Repeat("a/", 2100) + "x x") }, want: "more than 4096 bytes"},
		{name: "file-over-max-bytes", archive: func(untarSetup) []byte { return tarOf("f big " + strings.Repeat("x", 2048)) },
			lim: cpLimits{MaxBytes: 1024, MaxEntries: 100}, want: "more than 1.0 KiB (--max-bytes)"},
		{name: "sparse-bomb", archive: func(untarSetup) []byte { return paxSparse("bomb", 1<<40) }, want: "(--max-bytes)",
			check: func(t *testing.T, s untarSetup) {
				if es, _ := os.ReadDir(s.dst); len(es) != 0 {
					t.Errorf("the refused sparse file was made: %v", es)
				}
			}},
		{name: "files-over-max-bytes", archive: func(untarSetup) []byte {
			return tarOf("f a "+strings.Repeat("x", 700), "f b "+strings.Repeat("y", 700))
		}, lim: cpLimits{MaxBytes: 1024, MaxEntries: 100}, want: "(--max-bytes)"},
		{name: "stream-over-max-bytes", archive: func(untarSetup) []byte {
			// an entry of a type cage skips, with 4 KiB of data the
			// reader reads past: counted all the same
			return append(ustarBlock("odd", 'Z', 4096), bytes.Repeat([]byte("x"), 4096)...)
		}, lim: cpLimits{MaxBytes: 2048, MaxEntries: 100}, want: "(--max-bytes)"},
		{name: "too-many-entries", archive: func(untarSetup) []byte {
			var es []string
			for i := range 20 {
				es = append(es, fmt.Sprintf("f f%d x", i))
			}
			return tarOf(es...)
		}, lim: cpLimits{MaxBytes: 1 << 20, MaxEntries: 10}, want: "more than 10 entries (--max-entries)"},
		{name: "implicit-dirs-count", archive: func(untarSetup) []byte { return tarOf("f a/b/c/d/e/f x") },
			lim: cpLimits{MaxBytes: 1 << 20, MaxEntries: 3}, want: "more than 3 entries"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := newUntarSetup(t)
			lim := c.lim
			if lim.MaxBytes == 0 {
				lim = testLimits
			}
			err := s.run(t, c.archive(s), lim)
			s.untouched(t)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("untar: %v; want the copy allowed", err)
			case c.want != "" && err == nil:
				t.Fatalf("untar succeeded; want it refused with %q", c.want)
			case c.want != "" && !strings.Contains(err.Error(), c.want):
				t.Errorf("untar: %v; want %q", err, c.want)
			}
			if err != nil && strings.Contains(err.Error(), "\n") {
				t.Errorf("error of more than one line: %q", err)
			}
			if c.check != nil {
				c.check(t, s)
			}
		})
	}
}

func statOf(t testing.TB, p string) *unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return &st
}

// TestUntarHoles: zeros arrive as zeros (tar from a sandbox carries no
// sparse map, or a hostile one), and the host keeps them as holes.
func TestUntarHoles(t *testing.T) {
	s := newUntarSetup(t)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "zeros", Typeflag: tar.TypeReg, Mode: 0o644, Size: 8<<20 + 1})
	tw.Write(make([]byte, 8<<20))
	tw.Write([]byte("x"))
	tw.Close()
	data := append(buf.Bytes()[:len(buf.Bytes())-1024], paxSparse("sparse", 64<<20)...)
	if err := s.run(t, data, cpLimits{MaxBytes: 128 << 20, MaxEntries: 10}); err != nil {
		t.Fatal(err)
	}
	for name, size := range map[string]int64{"zeros": 8<<20 + 1, "sparse": 64 << 20} {
		st := statOf(t, filepath.Join(s.dst, name))
		if st.Size != size || st.Blocks*512 > 64<<10 {
			t.Errorf("%s: %d bytes taking %d on disk; want %d taking at most 64 KiB", name, st.Size, st.Blocks*512, size)
		}
	}
	b, _ := os.ReadFile(filepath.Join(s.dst, "sparse"))
	if string(b[4096:4101]) != "hello" || bytes.Count(b, []byte{0}) != len(b)-5 {
		t.Errorf("sparse: wrong contents")
	}
	b, _ = os.ReadFile(filepath.Join(s.dst, "zeros"))
	if b[len(b)-1] != 'x' || bytes.Count(b, []byte{0}) != len(b)-1 {
		t.Errorf("zeros: wrong contents")
	}
}

// TestSettle: the stage's entries move into the destination, merged into
// directories it has; a directory facing a file (a symlink the user's
// destination holds, say) is refused before anything moves, and a file
// replaces a symlink rather than being written through it.
func TestSettle(t *testing.T) {
	s := newUntarSetup(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(s.dst, "d/old"), 0o755))
	must(os.WriteFile(filepath.Join(s.dst, "keep"), []byte("keep"), 0o644))
	must(os.Symlink(filepath.Join(s.outside, "canary"), filepath.Join(s.dst, "link")))
	must(os.Symlink(s.outside, filepath.Join(s.dst, "evil")))
	stage := filepath.Join(s.dst, stagePrefix+"1")
	must(os.MkdirAll(filepath.Join(stage, "d/new"), 0o755))
	must(os.WriteFile(filepath.Join(stage, "link"), []byte("replaces the link"), 0o644))
	must(os.WriteFile(filepath.Join(stage, "f"), []byte("f"), 0o644))
	root, err := os.OpenRoot(s.dst)
	must(err)
	defer root.Close()

	// A directory where the destination has a symlink to outside: refused,
	// nothing moved.
	must(os.MkdirAll(filepath.Join(stage, "evil/sub"), 0o755))
	if err := settle(root, filepath.Base(stage)); err == nil || !strings.Contains(err.Error(), "evil") {
		t.Fatalf("settle over a symlink: %v; want it refused naming evil", err)
	}
	for _, p := range []string{"f", "d/new"} {
		if _, err := os.Lstat(filepath.Join(s.dst, p)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s moved although the copy was refused", p)
		}
	}
	s.untouched(t)

	must(os.RemoveAll(filepath.Join(stage, "evil")))
	if err := settle(root, filepath.Base(stage)); err != nil {
		t.Fatal(err)
	}
	s.untouched(t)
	for p, want := range map[string]string{"keep": "keep", "f": "f", "link": "replaces the link"} {
		if b, err := os.ReadFile(filepath.Join(s.dst, p)); err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", p, b, err, want)
		}
	}
	for _, d := range []string{"d/old", "d/new"} {
		if fi, err := os.Lstat(filepath.Join(s.dst, d)); err != nil || !fi.IsDir() {
			t.Errorf("%s: %v, %v; want a directory", d, fi, err)
		}
	}
}

// FuzzUntar feeds the host side of `cage cp` arbitrary tar streams, as a
// hostile sandbox may send, beside a directory holding a canary, and checks
// what any stream must leave: no panic, one-line errors, nothing made or
// changed outside the destination, at most MaxEntries entries and MaxBytes
// bytes of files in it (holes included), only directories, regular files
// and symlinks, no setuid, setgid or sticky bit, and no hard link to
// anything outside.
func FuzzUntar(f *testing.F) {
	f.Add(tarOf("d a/", "f a/b hello", "s a/l b", "h a/h a/b"))
	f.Add(tarOf("s evil ../outside", "f evil/canary pwned", "d evil/sub/"))
	f.Add(tarOf("d sub/", "s link sub", "f link/x through", "h h link/x"))
	f.Add(tarOf("f ../outside/canary pwned", "f /abs x", "h h ../outside/canary", "p fifo", "c null", "F suid x"))
	f.Add(tarOf("f f ok", "s f ../outside/canary", "d f/"))
	f.Add(tarOf("f " + strings.Repeat("d/", 300) + "deep deep"))
	f.Add(tarOf("f " + strings.Repeat("n", 255) + "/" + strings.Repeat("m", 3000) + " long"))
	f.Add(paxSparse("sparse", 1<<20))
	f.Add(paxSparse("bomb", 1<<40))
	lim := cpLimits{MaxBytes: 1 << 20, MaxEntries: 64}
	f.Fuzz(func(t *testing.T, data []byte) {
		s := newUntarSetup(t)
		err := s.run(t, data, lim)
		if err != nil && strings.Contains(err.Error(), "\n") {
			t.Errorf("error of more than one line: %q", err)
		}
		s.untouched(t)
		entries, size := 0, int64(0)
		seen := map[uint64]bool{}
		filepath.WalkDir(s.dst, func(p string, d fs.DirEntry, err error) error {
			if err != nil || p == s.dst {
				return err
			}
			entries++
			st := statOf(t, p)
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFDIR, unix.S_IFLNK:
			case unix.S_IFREG:
				if !seen[st.Ino] {
					seen[st.Ino] = true
					size += st.Size
				}
			default:
				t.Errorf("%s: mode %o made", p, st.Mode)
			}
			if st.Mode&0o7000 != 0 {
				t.Errorf("%s: mode %o", p, st.Mode)
			}
			return nil
		})
		if entries > lim.MaxEntries || size > lim.MaxBytes {
			t.Errorf("%d entries and %d bytes of files, over the bounds %d and %d", entries, size, lim.MaxEntries, lim.MaxBytes)
		}
		checkLinksInside(t, s.dst)
	})
}

// checkLinksInside: every regular file's links are all in dir.
func checkLinksInside(t *testing.T, dir string) {
	t.Helper()
	seen := map[uint64]uint64{}
	nlink := map[uint64]uint64{}
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			st := statOf(t, p)
			seen[st.Ino]++
			nlink[st.Ino] = uint64(st.Nlink)
		}
		return nil
	})
	for ino, n := range seen {
		if nlink[ino] != n {
			t.Errorf("inode %d has %d links, %d of them in the destination", ino, nlink[ino], n)
		}
	}
}
