package imgstore

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"
)

var sampleConfig = v1.Config{
	Env:        []string{"PATH=/bin", "GREETING=hi"},
	WorkingDir: "/work",
	User:       "1000:1000",
	Entrypoint: []string{"/bin/sh", "-c"},
	Cmd:        []string{"echo hi"},
	Labels:     map[string]string{"org.example.kind": "sample"},
}

// sampleLayers: files with owners, modes, setuid, xattrs (one kept, two
// dropped), a symlink and a hard link; then a second layer.
func sampleLayers(t *testing.T) [][]byte {
	l1 := newLayer(t).
		dir("./", 0o755).
		dir("etc/", 0o755).
		add(tar.Header{Name: "etc/owned", Typeflag: tar.TypeReg, Mode: 0o640, Uid: 1000, Gid: 1000, PAXRecords: map[string]string{
			"SCHILY.xattr.user.note":           "kept",
			"SCHILY.xattr.trusted.evil":        "dropped",
			"SCHILY.xattr.security.capability": "dropped",
		}}, "owned by 1000\n").
		dir("bin/", 0o755).
		file("bin/busybox", "#!busybox\n", 0o755).
		add(tar.Header{Name: "bin/su", Typeflag: tar.TypeReg, Mode: 0o4755}, "su\n").
		symlink("bin/sh", "busybox").
		hardlink("bin/ash", "bin/busybox").
		bytes()
	l2 := newLayer(t).
		dir("tmp/", 0o1777).
		file("etc/motd", "hello\n", 0o644).
		bytes()
	return [][]byte{l1, l2}
}

const sampleSize = int64(len("owned by 1000\n") + len("#!busybox\n") + len("su\n") + len("hello\n"))

func TestImportFormats(t *testing.T) {
	requireRoot(t)
	layers := sampleLayers(t)
	gzImg := buildImage(t, sampleConfig, layers)
	zstdImg := buildImage(t, sampleConfig, layers, tarball.WithCompression(compression.ZStd))
	id, err := gzImg.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	cases := []struct {
		name   string
		source string // prefix of Template.Source
		run    func(t *testing.T, s *Store, o Options) (*Template, error)
	}{
		{"docker-save", "docker-archive:/", func(t *testing.T, s *Store, o Options) (*Template, error) {
			return s.Import(ctx, writeDockerSave(t, gzImg, "sample:latest"), "sample", o)
		}},
		{"oci-dir-zstd", "oci-layout:/", func(t *testing.T, s *Store, o Options) (*Template, error) {
			return s.Import(ctx, writeOCIDir(t, zstdImg, "latest"), "sample", o)
		}},
		{"oci-tar", "oci-layout:/", func(t *testing.T, s *Store, o Options) (*Template, error) {
			return s.Import(ctx, tarDir(t, writeOCIDir(t, gzImg, "sample:latest")), "sample", o)
		}},
		{"registry", "registry:127.0.0.1:", func(t *testing.T, s *Store, o Options) (*Template, error) {
			ref := startRegistry(t) + "/cage/sample:v1"
			push(t, gzImg, ref)
			if _, err := s.Pull(ctx, ref, "sample", Options{}); err == nil || !strings.Contains(err.Error(), "plain http") {
				t.Errorf("Pull without Insecure from an http registry: %v, want a refusal", err)
			}
			o.Insecure = true
			return s.Pull(ctx, ref, "sample", o)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := openStore(t)
			var p progressLog
			tm, err := c.run(t, s, Options{Progress: p.f})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(tm.Source, c.source) {
				t.Errorf("Source = %q, want prefix %q", tm.Source, c.source)
			}
			if tm.ID != id.String() {
				t.Errorf("ID = %s, want %s", tm.ID, id)
			}
			checkSample(t, s, tm, layers)
			if p.count("dropped 2 xattr") != 1 {
				t.Errorf("progress %q: want one note of 2 dropped xattrs", p.lines)
			}
			if p.count("layer 1/2 sha256:") < 1 || p.count("layer 2/2 sha256:") < 1 {
				t.Errorf("progress %q: want a line per layer", p.lines)
			}
		})
	}
}

func checkSample(t *testing.T, s *Store, tm *Template, layers [][]byte) {
	t.Helper()
	if want := []string{diffID(layers[0]), diffID(layers[1])}; !reflect.DeepEqual(tm.Layers, want) {
		t.Errorf("Layers = %q, want %q", tm.Layers, want)
	}
	want := Config{Env: sampleConfig.Env, WorkingDir: "/work", User: "1000:1000", Entrypoint: sampleConfig.Entrypoint, Cmd: sampleConfig.Cmd, Labels: sampleConfig.Labels}
	if !reflect.DeepEqual(tm.Config, want) {
		t.Errorf("Config = %+v, want %+v", tm.Config, want)
	}
	if tm.Size != sampleSize {
		t.Errorf("Size = %d, want %d", tm.Size, sampleSize)
	}
	if tm.Name != "sample" || tm.Created.IsZero() {
		t.Errorf("Name %q Created %v", tm.Name, tm.Created)
	}
	got, err := s.Get("sample")
	if err != nil || !reflect.DeepEqual(got, tm) {
		t.Errorf("Get = %+v, %v; want %+v", got, err, tm)
	}
	list, err := s.List()
	if err != nil || len(list) != 1 || list[0].Name != "sample" {
		t.Errorf("List = %+v, %v", list, err)
	}
	dirs, err := s.LayerDirs(tm)
	if err != nil || len(dirs) != 2 {
		t.Fatalf("LayerDirs = %q, %v", dirs, err)
	}
	l1, l2 := dirs[0], dirs[1]

	if st := lstat(t, l1); st.Mode&0o7777 != 0o755 {
		t.Errorf("layer root mode %o", st.Mode&0o7777)
	}
	owned := filepath.Join(l1, "etc/owned")
	st := lstat(t, owned)
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o7777 != 0o640 || st.Uid != 1000 || st.Gid != 1000 {
		t.Errorf("etc/owned: mode %o owner %d:%d", st.Mode, st.Uid, st.Gid)
	}
	if st.Mtim.Sec != testTime.Unix() {
		t.Errorf("etc/owned mtime %d, want %d", st.Mtim.Sec, testTime.Unix())
	}
	if st := lstat(t, filepath.Join(l1, "etc")); st.Mtim.Sec != testTime.Unix() {
		t.Errorf("etc mtime %d, want %d (set after its entries were made)", st.Mtim.Sec, testTime.Unix())
	}
	if got := readFile(t, owned); got != "owned by 1000\n" {
		t.Errorf("etc/owned = %q", got)
	}
	if v, err := getxattr(owned, "user.note"); err != nil || v != "kept" {
		t.Errorf("user.note = %q, %v", v, err)
	}
	for _, x := range []string{"trusted.evil", "security.capability"} {
		if _, err := getxattr(owned, x); !errors.Is(err, unix.ENODATA) {
			t.Errorf("%s: %v, want ENODATA (dropped)", x, err)
		}
	}
	if st := lstat(t, filepath.Join(l1, "bin/su")); st.Mode&0o7777 != 0o4755 || st.Uid != 0 {
		t.Errorf("bin/su: mode %o uid %d, want 4755 root", st.Mode&0o7777, st.Uid)
	}
	if target, err := os.Readlink(filepath.Join(l1, "bin/sh")); err != nil || target != "busybox" {
		t.Errorf("bin/sh -> %q, %v", target, err)
	}
	bb, ash := lstat(t, filepath.Join(l1, "bin/busybox")), lstat(t, filepath.Join(l1, "bin/ash"))
	if bb.Ino != ash.Ino || bb.Nlink != 2 {
		t.Errorf("bin/ash is not a hard link of bin/busybox (inodes %d %d, nlink %d)", bb.Ino, ash.Ino, bb.Nlink)
	}
	if st := lstat(t, filepath.Join(l2, "tmp")); st.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o, want 1777", st.Mode&0o7777)
	}
	if got := readFile(t, filepath.Join(l2, "etc/motd")); got != "hello\n" {
		t.Errorf("etc/motd = %q", got)
	}
}

func TestOpenMode(t *testing.T) {
	requireRoot(t)
	dir := filepath.Join(t.TempDir(), "store")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if st := lstat(t, s.Dir()); st.Mode&0o777 != 0o700 {
		t.Errorf("store mode %o, want 700", st.Mode&0o777)
	}
	if _, err := s.Get("nothing"); !errors.Is(err, ErrNotFound) || err.Error() != `template not found: "nothing"` {
		t.Errorf("Get(nothing) = %v", err)
	}
	if err := s.Remove("nothing"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Remove(nothing) = %v", err)
	}
}

func TestWhiteoutsAndOverlay(t *testing.T) {
	requireRoot(t)
	l1 := newLayer(t).
		dir("a/", 0o755).file("a/x", "x", 0o644).file("a/keep", "keep", 0o644).
		dir("b/", 0o755).file("b/y", "y", 0o644).
		bytes()
	l2 := newLayer(t).
		dir("a/", 0o755).file("a/.wh.x", "", 0o644).
		dir("b/", 0o755).file("b/.wh..wh..opq", "", 0o644).file("b/z", "z", 0o644).
		bytes()
	s := openStore(t)
	tm, err := s.Import(context.Background(), writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{l1, l2}), "wh:latest"), "wh", Options{})
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := s.LayerDirs(tm)
	if err != nil {
		t.Fatal(err)
	}
	st := lstat(t, filepath.Join(dirs[1], "a/x"))
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("a/x in layer 2: mode %o rdev %d, want a 0:0 character device", st.Mode, st.Rdev)
	}
	// With its entry's time, as every entry: the same layer unpacks to the
	// same tree whenever it is imported.
	if got := time.Unix(st.Mtim.Unix()); !got.Equal(testTime) {
		t.Errorf("a/x in layer 2: mtime %v, want the entry's %v", got, testTime)
	}
	if v, err := getxattr(filepath.Join(dirs[1], "b"), "trusted.overlay.opaque"); err != nil || v != "y" {
		t.Errorf("b opaque xattr = %q, %v", v, err)
	}
	for _, p := range []string{"a/.wh.x", "b/.wh..wh..opq"} {
		if _, err := os.Lstat(filepath.Join(dirs[1], p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s exists in the layer: %v", p, err)
		}
	}

	merged := t.TempDir()
	if err := unix.Mount(MountSource(tm), merged, "overlay", unix.MS_RDONLY, "lowerdir="+dirs[1]+":"+dirs[0]); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	if _, err := os.Lstat(filepath.Join(merged, "a/x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a/x through overlay: %v, want gone", err)
	}
	if got := readFile(t, filepath.Join(merged, "a/keep")); got != "keep" {
		t.Errorf("a/keep = %q", got)
	}
	es, err := os.ReadDir(filepath.Join(merged, "b"))
	if err != nil || len(es) != 1 || es[0].Name() != "z" {
		t.Errorf("b through overlay = %v, %v; want only z", es, err)
	}
}

func TestLayerSharing(t *testing.T) {
	requireRoot(t)
	base := newLayer(t).dir("usr/", 0o755).file("usr/base", "base", 0o644).bytes()
	x := newLayer(t).file("x", "x", 0o644).bytes()
	y := newLayer(t).file("y", "y", 0o644).bytes()
	s := openStore(t)
	ctx := context.Background()
	var pa, pb progressLog
	a, err := s.Import(ctx, writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{base, x}), "a:latest"), "a", Options{Progress: pa.f})
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Import(ctx, writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{base, y}), "b:latest"), "b", Options{Progress: pb.f})
	if err != nil {
		t.Fatal(err)
	}
	if pa.count("reused") != 0 || pb.count("reused") != 1 {
		t.Errorf("reused layers: a %q, b %q; want the base reused by b only", pa.lines, pb.lines)
	}
	da, _ := s.LayerDirs(a)
	db, _ := s.LayerDirs(b)
	if da[0] != db[0] {
		t.Errorf("base layer dirs differ: %s %s", da[0], db[0])
	}
	if n := countLayerDirs(t, s); n != 3 {
		t.Errorf("%d layer dirs, want 3", n)
	}

	// Crash leftovers: a staging dir nobody holds, a temp record.
	os.MkdirAll(filepath.Join(s.Dir(), "layers/.tmp-crashed/root/usr"), 0o700)
	os.WriteFile(filepath.Join(s.Dir(), "templates/.tmp-crashed.json"), []byte("{"), 0o600)

	if err := s.Remove("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(da[0]); err != nil {
		t.Errorf("shared base layer removed with a: %v", err)
	}
	if _, err := os.Stat(da[1]); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a's own layer kept: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Dir(), "layers/.tmp-crashed")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("crash leftover kept: %v", err)
	}
	if _, err := s.LayerDirs(b); err != nil {
		t.Errorf("b lost a layer: %v", err)
	}
	if err := s.Remove("b"); err != nil {
		t.Fatal(err)
	}
	removed, err := s.GC()
	if err != nil || len(removed) != 0 {
		t.Errorf("GC after removing both = %q, %v; want nothing left to remove", removed, err)
	}
	for _, sub := range []string{"layers", "configs", "templates"} {
		if es, _ := os.ReadDir(filepath.Join(s.Dir(), sub)); len(es) != 0 {
			t.Errorf("%s not empty after removing everything: %v", sub, es)
		}
	}
	if _, err := s.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(a) after Remove = %v", err)
	}
}

func TestGCKeepsWhatImportsHold(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	// An import in progress: its stage is locked.
	st, err := s.newStage()
	if err != nil {
		t.Fatal(err)
	}
	defer st.discard()
	// A layer nobody references, but an import has pinned.
	l := newLayer(t).file("f", "f", 0o644).bytes()
	tm, err := importRaw(t, s, Options{}, l)
	if err != nil {
		t.Fatal(err)
	}
	hx := tm.Layers[0][len("sha256:"):]
	pin, _, ok, err := s.pinLayer(hx)
	if err != nil || !ok {
		t.Fatalf("pinLayer: %v %v", ok, err)
	}
	os.Remove(filepath.Join(s.Dir(), "templates", tm.Name+".json")) // now unreferenced
	removed, err := s.GC()
	if err != nil || len(removed) != 0 {
		t.Errorf("GC with a pinned layer = %q, %v; want nothing removed", removed, err)
	}
	if _, err := os.Stat(st.dir); err != nil {
		t.Errorf("GC removed a stage in use: %v", err)
	}
	pin.Close()
	removed, err = s.GC()
	if err != nil || len(removed) != 1 || removed[0] != tm.Layers[0] {
		t.Errorf("GC once unpinned = %q, %v; want %s", removed, err, tm.Layers[0])
	}
}

func TestRemoveInUse(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	tm, err := importRaw(t, s, Options{}, newLayer(t).file("f", "f", 0o644).bytes())
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := s.LayerDirs(tm)
	if err != nil {
		t.Fatal(err)
	}
	// The way a sandbox mounts it: under the store's shared lock.
	unlock, err := s.RLock()
	if err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(t.TempDir(), "rootfs")
	os.Mkdir(mnt, 0o755)
	work := t.TempDir()
	upper, wd := filepath.Join(work, "upper"), filepath.Join(work, "work")
	os.Mkdir(upper, 0o755)
	os.Mkdir(wd, 0o755)
	err = unix.Mount(MountSource(tm), mnt, "overlay", 0, "lowerdir="+dirs[0]+",upperdir="+upper+",workdir="+wd)
	unlock()
	if err != nil {
		t.Fatalf("mount: %v", err)
	}
	mounted := true
	defer func() {
		if mounted {
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	}()
	if users := InUse(tm); len(users) != 1 || users[0] != mnt {
		t.Errorf("InUse = %q, want [%s]", users, mnt)
	}
	err = s.Remove(tm.Name)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), `template "evil" is in use by 1 sandbox(es): `+mnt) {
		t.Fatalf("Remove while mounted = %v", err)
	}
	if _, err := s.Get(tm.Name); err != nil {
		t.Errorf("template gone after a refused Remove: %v", err)
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	mounted = false
	if err := s.Remove(tm.Name); err != nil {
		t.Fatalf("Remove after unmount: %v", err)
	}
	if n := countLayerDirs(t, s); n != 0 {
		t.Errorf("%d layer dirs left", n)
	}
}

func TestPickImage(t *testing.T) {
	requireRoot(t)
	one := buildImage(t, v1.Config{Cmd: []string{"one"}}, [][]byte{newLayer(t).file("one", "1", 0o644).bytes()})
	two := buildImage(t, v1.Config{Cmd: []string{"two"}}, [][]byte{newLayer(t).file("two", "2", 0o644).bytes()})
	p := filepath.Join(t.TempDir(), "multi.tar")
	err := tarball.MultiRefWriteToFile(p, map[name.Reference]v1.Image{
		name.MustParseReference("one:latest"):                     one,
		name.MustParseReference("registry.example/team/two:3.12"): two,
	})
	if err != nil {
		t.Fatal(err)
	}
	s := openStore(t)
	ctx := context.Background()
	tm, err := s.Import(ctx, p, "two", Options{})
	if err != nil || !reflect.DeepEqual(tm.Config.Cmd, []string{"two"}) {
		t.Errorf("Import two = %+v, %v", tm, err)
	}
	tm, err = s.Import(ctx, p, "one", Options{})
	if err != nil || !reflect.DeepEqual(tm.Config.Cmd, []string{"one"}) {
		t.Errorf("Import one = %+v, %v", tm, err)
	}
	_, err = s.Import(ctx, p, "three", Options{})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "one:latest") || !strings.Contains(err.Error(), "team/two:3.12") {
		t.Errorf("Import three = %v, want an error listing the images", err)
	}
}

func countLayerDirs(t *testing.T, s *Store) int {
	t.Helper()
	n := 0
	for _, e := range layerEntries(t, s) {
		if hexRE().MatchString(e) {
			n++
		}
	}
	return n
}

func TestReplaceWhileMounted(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	ctx := context.Background()
	v1Layer := newLayer(t).file("version", "1", 0o644).bytes()
	old, err := s.Import(ctx, writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{v1Layer}), "r:latest"), "r", Options{})
	if err != nil {
		t.Fatal(err)
	}
	dirs, _ := s.LayerDirs(old)
	// Two users of the old layer: an overlay (lowerdir) and a bind (root).
	overlay, bind := t.TempDir(), t.TempDir()
	if err := unix.Mount(MountSource(old), overlay, "overlay", unix.MS_RDONLY, "lowerdir="+dirs[0]+":"+t.TempDir()); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	defer unix.Unmount(overlay, unix.MNT_DETACH)
	if err := unix.Mount(dirs[0], bind, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind: %v", err)
	}
	defer unix.Unmount(bind, unix.MNT_DETACH)

	v2Layer := newLayer(t).file("version", "2", 0o644).bytes()
	nu, err := s.Import(ctx, writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{v2Layer}), "r:latest"), "r", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get("r"); got == nil || got.ID != nu.ID {
		t.Errorf("Get(r) after the replacement = %+v", got)
	}
	for _, mnt := range []string{overlay, bind} {
		if got := readFile(t, filepath.Join(mnt, "version")); got != "1" {
			t.Errorf("a running sandbox's root changed: %s/version = %q", mnt, got)
		}
	}
	if err := unix.Unmount(overlay, 0); err != nil {
		t.Fatal(err)
	}
	if removed, err := s.GC(); err != nil || len(removed) != 0 {
		t.Errorf("GC while bound = %q, %v; want nothing removed", removed, err)
	}
	if err := unix.Unmount(bind, 0); err != nil {
		t.Fatal(err)
	}
	removed, err := s.GC()
	if err != nil || len(removed) != 1 || removed[0] != old.Layers[0] {
		t.Errorf("GC after unmount = %q, %v; want the old layer", removed, err)
	}
}

func TestLayerListedTwice(t *testing.T) {
	requireRoot(t)
	base := newLayer(t).file("f", "base", 0o644).file("only-base", "b", 0o644).bytes()
	mid := newLayer(t).file("f", "mid", 0o644).file(".wh.only-base", "", 0).bytes()
	s := openStore(t)
	ctx := context.Background()
	var p progressLog
	tm, err := s.Import(ctx, writeDockerSave(t, buildImage(t, v1.Config{}, [][]byte{base, mid, base}), "twice:latest"), "twice", Options{Progress: p.f})
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Layers) != 3 || tm.Layers[0] != tm.Layers[2] {
		t.Errorf("Layers = %q, want the config's three", tm.Layers)
	}
	if p.count("layer 3/3") != 1 || p.count("reused") != 1 {
		t.Errorf("progress %q: want layer 3 reused", p.lines)
	}
	dirs, err := s.LayerDirs(tm)
	if err != nil || len(dirs) != 2 || !strings.HasSuffix(dirs[1], tm.Layers[0][7:]) {
		t.Fatalf("LayerDirs = %q, %v; want [mid base]", dirs, err)
	}
	merged := t.TempDir()
	if err := unix.Mount(MountSource(tm), merged, "overlay", unix.MS_RDONLY, "lowerdir="+dirs[1]+":"+dirs[0]); err != nil {
		t.Fatalf("mount: %v", err)
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	if got := readFile(t, filepath.Join(merged, "f")); got != "base" {
		t.Errorf("f = %q, want the top layer's", got)
	}
	if got := readFile(t, filepath.Join(merged, "only-base")); got != "b" {
		t.Errorf("only-base = %q, want it back from the top layer", got)
	}
	var out bytes.Buffer
	if err := s.Export(ctx, "twice", &out); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t)
	p2 := filepath.Join(t.TempDir(), "twice.tar")
	os.WriteFile(p2, out.Bytes(), 0o600)
	back, err := s2.Import(ctx, p2, "twice", Options{})
	if err != nil || back.ID != tm.ID || !reflect.DeepEqual(back.Layers, tm.Layers) {
		t.Errorf("round trip = %+v, %v", back, err)
	}
}

func TestPlatformFromIndex(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	amd := buildImage(t, v1.Config{Cmd: []string{"amd64"}}, [][]byte{newLayer(t).file("arch", "amd64", 0o644).bytes()})
	arm := buildImage(t, v1.Config{Cmd: []string{"arm64"}}, [][]byte{newLayer(t).file("arch", "arm64", 0o644).bytes()})
	cf, _ := arm.ConfigFile()
	cf = cf.DeepCopy()
	cf.Architecture = "arm64"
	arm, _ = mutate.ConfigFile(arm, cf)
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	dir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": "multi:latest"})); err != nil {
		t.Fatal(err)
	}
	s := openStore(t)
	tm, err := s.Import(ctx, dir, "multi", Options{})
	if err != nil || !reflect.DeepEqual(tm.Config.Cmd, []string{"amd64"}) {
		t.Errorf("Import from an OCI index = %+v, %v; want the amd64 image", tm, err)
	}

	ref := startRegistry(t) + "/multi:latest"
	r, _ := name.ParseReference(ref, name.Insecure)
	if err := remote.WriteIndex(r, idx); err != nil {
		t.Fatal(err)
	}
	tm, err = s.Pull(ctx, ref, "multi", Options{Insecure: true})
	if err != nil || !reflect.DeepEqual(tm.Config.Cmd, []string{"amd64"}) {
		t.Errorf("Pull of an index = %+v, %v; want the amd64 image", tm, err)
	}
}

// A build's staging file (a layer's tar before AddLayer reads it) is in
// the store, kept by GC while its owner has it open, removed by Close,
// and removed by GC once its owner is gone without removing it.
func TestStagingFile(t *testing.T) {
	requireRoot(t)
	s := openStore(t)
	f, err := s.Staging()
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Dir(f.Name()) != filepath.Join(s.Dir(), "layers") {
		t.Errorf("staging file %s; want it in the store's layers", f.Name())
	}
	if _, err := f.WriteString("tar"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.Name()); err != nil {
		t.Errorf("GC removed a staging file in use: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.Name()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("staging file after Close: %v; want it removed", err)
	}
	// An owner that died: its file is there, its lock gone.
	left, err := s.Staging()
	if err != nil {
		t.Fatal(err)
	}
	left.File.Close()
	if _, err := s.GC(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(left.Name()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a dead build's staging file after GC: %v; want it removed", err)
	}
}
