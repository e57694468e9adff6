package template

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
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
	must(os.WriteFile(filepath.Join(src, "dir", "sub", "f"), []byte("x"), 0o444))
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
	if fi, _ := os.Stat(filepath.Join(a, "dir", "sub", "f")); fi == nil || fi.Mode().Perm() != 0o444 {
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

// TestEtcCopiesOnlyWhatOthersRead: the host template's /etc holds only
// what every host user may read of the listed entries. gVisor's root
// inside holds every file's rights (its kernel maps no ids), so a file
// the copy kept root's alone was its to read: found by review,
// 2026-12-03, `cage run --wall gvisor --user root` printed the host's
// /etc/ssl/private/ssl-cert-snakeoil.key.
func TestEtcCopiesOnlyWhatOthersRead(t *testing.T) {
	src, cache := t.TempDir(), cacheDir(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "ssl", "certs"), 0o755))
	must(os.WriteFile(filepath.Join(src, "ssl", "certs", "ca.pem"), []byte("public"), 0o644))
	must(os.Mkdir(filepath.Join(src, "ssl", "private"), 0o710))
	must(os.WriteFile(filepath.Join(src, "ssl", "private", "host.key"), []byte("PRIVATE"), 0o640))
	must(os.WriteFile(filepath.Join(src, "ssl", "secret.conf"), []byte("PRIVATE"), 0o600))
	must(os.Mkdir(filepath.Join(src, "listable"), 0o755))
	must(os.Mkdir(filepath.Join(src, "listable", "closed"), 0o750))
	must(os.WriteFile(filepath.Join(src, "listable", "closed", "f"), []byte("PRIVATE"), 0o644))
	must(os.WriteFile(filepath.Join(src, "token"), []byte("PRIVATE"), 0o640))
	dir, err := etcCache(cache, src, []string{"ssl", "listable", "token"})
	must(err)
	if b, err := os.ReadFile(filepath.Join(dir, "ssl", "certs", "ca.pem")); err != nil || string(b) != "public" {
		t.Errorf("a file every user reads is not in the copy: %q, %v", b, err)
	}
	for _, p := range []string{"ssl/private", "ssl/secret.conf", "listable/closed", "token"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); err == nil {
			t.Errorf("%s is in the copy, though only root (or its group) may read it on the host", p)
		}
	}
}

// TestEtcManifest: the fingerprint of the host's /etc comes from the
// manifest of the last walk while every state in it holds, and from a new
// walk as soon as one does not: an entry added in a nested directory, a
// new subdirectory, a listed entry that was absent and appears, a top-level
// file rewritten, a manifest that is not one.
func TestEtcManifest(t *testing.T) {
	src, cache := t.TempDir(), t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(src, "conf"), []byte("one"), 0o644))
	must(os.MkdirAll(filepath.Join(src, "my dir", "sub"), 0o755))
	entries := []string{"conf", "my dir", "absent"}
	manifest := filepath.Join(cache, ".etc-manifest")
	// staleSum writes into the manifest a sum no walk gives, as a manifest
	// made before a change would hold.
	const staleSum = "0123456789abcdef"
	stale := func() {
		t.Helper()
		b, err := os.ReadFile(manifest)
		must(err)
		lines := strings.Split(string(b), "\n")
		lines[1] = staleSum
		must(os.WriteFile(manifest, []byte(strings.Join(lines, "\n")), 0o644))
	}
	first, err := fingerprint(cache, src, entries)
	must(err)
	if want := walkedSum(t, src, entries); first != want {
		t.Fatalf("first fingerprint %s, a walk's %s", first, want)
	}
	// The manifest stands while its states hold.
	stale()
	if got, _ := fingerprint(cache, src, entries); got != staleSum {
		t.Fatalf("manifest not used: %s", got)
	}
	for _, c := range []struct {
		name string
		do   func()
	}{
		{"a file added in a nested directory", func() { must(os.WriteFile(filepath.Join(src, "my dir", "sub", "new"), nil, 0o644)) }},
		{"a new subdirectory", func() { must(os.Mkdir(filepath.Join(src, "my dir", "sub", "deeper"), 0o755)) }},
		{"an absent entry appears", func() { must(os.WriteFile(filepath.Join(src, "absent"), nil, 0o644)) }},
		{"a top-level file rewritten", func() { must(os.WriteFile(filepath.Join(src, "conf"), []byte("two!"), 0o644)) }},
	} {
		time.Sleep(10 * time.Millisecond) // a new mtime on coarse clocks
		stale()
		c.do()
		got, err := fingerprint(cache, src, entries)
		must(err)
		if want := walkedSum(t, src, entries); got != want {
			t.Errorf("%s: fingerprint %s, a walk's %s", c.name, got, want)
		}
	}
	for _, junk := range []string{"", "x", "key\nsum\n", "\n\n\n"} {
		must(os.WriteFile(manifest, []byte(junk), 0o644))
		if got, err := fingerprint(cache, src, entries); err != nil || got != walkedSum(t, src, entries) {
			t.Errorf("manifest %q: fingerprint %s (%v)", junk, got, err)
		}
	}
}

// walkedSum is the fingerprint a walk gives (no manifest).
func walkedSum(t *testing.T, src string, entries []string) string {
	t.Helper()
	sum, err := fingerprint(t.TempDir(), src, entries)
	if err != nil {
		t.Fatal(err)
	}
	return sum
}
