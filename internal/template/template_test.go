package template

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/inside"
)

func TestLookupUnknown(t *testing.T) {
	if _, err := Lookup("no-such-template", t.TempDir(), nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("want ErrNotFound, got %v", err)
	}
}

func cacheDir(t *testing.T) string {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root (template caches are tmpfs mounts)")
	}
	dir := t.TempDir()
	t.Cleanup(func() {
		ents, _ := filepath.Glob(filepath.Join(dir, "*", "etc-*"))
		ents2, _ := filepath.Glob(filepath.Join(dir, "etc-*"))
		for _, e := range append(ents, ents2...) {
			RemoveCache(e)
		}
	})
	return dir
}

func TestHostTemplate(t *testing.T) {
	tmpl, err := Lookup("host", cacheDir(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	var etc, usr bool
	for _, m := range tmpl.Mounts {
		switch m.Dest {
		case "/etc":
			etc = m.Kind == inside.Dir && m.Source == tmpl.EtcCache
		case "/usr":
			usr = m.Kind == inside.Dir && m.Source == "/usr"
		}
	}
	if !etc || !usr {
		t.Fatalf("mounts: %+v", tmpl.Mounts)
	}
	for _, f := range []string{"passwd", "group", "nsswitch.conf"} {
		if _, err := os.Stat(filepath.Join(tmpl.EtcCache, f)); err != nil {
			t.Errorf("%s missing from the template's /etc: %v", f, err)
		}
	}
	if target, _ := os.Readlink(filepath.Join(tmpl.EtcCache, "hosts")); target != "/run/cage/hosts" {
		t.Errorf("hosts links to %q", target)
	}
}

func TestEtcCacheFollowsTheHost(t *testing.T) {
	src, cache := t.TempDir(), cacheDir(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(src, "conf"), []byte("one"), 0o644))
	must(os.MkdirAll(filepath.Join(src, "dir", "sub"), 0o755))
	must(os.WriteFile(filepath.Join(src, "dir", "sub", "f"), []byte("x"), 0o600))
	must(os.Symlink("sub/f", filepath.Join(src, "dir", "link")))
	entries := []string{"conf", "dir", "absent"}

	a, err := etcCache(cache, src, entries)
	must(err)
	b, err := etcCache(cache, src, entries)
	must(err)
	if a != b {
		t.Fatalf("unchanged sources made a second copy: %s, %s", a, b)
	}
	if got, _ := os.ReadFile(filepath.Join(a, "dir", "sub", "f")); string(got) != "x" {
		t.Errorf("nested file: %q", got)
	}
	if fi, _ := os.Stat(filepath.Join(a, "dir", "sub", "f")); fi == nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("mode not kept: %v", fi)
	}
	if l, _ := os.Readlink(filepath.Join(a, "dir", "link")); l != "sub/f" {
		t.Errorf("symlink: %q", l)
	}

	// A package manager adds a file in a nested directory.
	time.Sleep(10 * time.Millisecond)
	must(os.WriteFile(filepath.Join(src, "dir", "sub", "new"), []byte("y"), 0o644))
	c, err := etcCache(cache, src, entries)
	must(err)
	if c == a {
		t.Fatal("a changed source kept the old copy")
	}
	if _, err := os.Stat(filepath.Join(c, "dir", "sub", "new")); err != nil {
		t.Errorf("new file missing from the new copy: %v", err)
	}
	if _, err := os.Stat(filepath.Join(a, "conf")); err != nil {
		t.Errorf("the old copy must stay for sandboxes still using it: %v", err)
	}
}
