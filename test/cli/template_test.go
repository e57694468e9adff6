package clitest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// TestTemplateCommands: import a `docker save` tarball, list, inspect, run
// from it, export it and import the export, refuse bad input with one line
// and the right code, and remove it.
func TestTemplateCommands(t *testing.T) {
	e := setup(t)
	data := t.TempDir()
	env := []string{"CAGE_DATA=" + data}
	tarPath := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")

	r := e.cageEnv(nil, env, "template", "import", tarPath, "bb")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "bb ") || !strings.Contains(r.stdout, "2 layers") {
		t.Fatalf("template import: %v", r)
	}
	r = e.cageEnv(nil, env, "template", "ls")
	if r.code != 0 || !strings.Contains(r.stdout, "\nbb ") || !strings.Contains(r.stdout, "host") {
		t.Errorf("template ls: %v", r)
	}
	r = e.cageEnv(nil, env, "template", "inspect", "bb")
	if r.code != 0 || !strings.Contains(r.stdout, `"org.cage.test": "yes"`) || !strings.Contains(r.stdout, `"inUse": []`) {
		t.Errorf("template inspect: %v", r)
	}
	// cage run from the template: the image's files, the sandbox's user.
	r = e.cageEnv(nil, env, "run", "--template", "bb", "--", "sh", "-c", "head -1 /etc/os-release; id -u")
	if r.code != 0 || r.stdout != "ID=cage-test\n1000\n" {
		t.Errorf("cage run --template bb: %v", r)
	}
	e.noLeftovers(r.ids...)
	// Export and import the export under another name: same layers.
	out := filepath.Join(t.TempDir(), "bb.tar")
	if r = e.cageEnv(nil, env, "template", "export", "bb", "-o", out); r.code != 0 {
		t.Fatalf("template export: %v", r)
	}
	if fi, err := os.Stat(out); err != nil || fi.Size() < 1<<20 {
		t.Fatalf("export wrote %v, %v", fi, err)
	}
	if r = e.cageEnv(nil, env, "template", "import", out, "bb2"); r.code != 0 {
		t.Fatalf("import of the export: %v", r)
	}
	a := e.cageEnv(nil, env, "template", "inspect", "bb")
	b := e.cageEnv(nil, env, "template", "inspect", "bb2")
	if layers(a.stdout) == "" || layers(a.stdout) != layers(b.stdout) {
		t.Errorf("export round trip changed the layers:\n%s\n%s", layers(a.stdout), layers(b.stdout))
	}
	// Bad input: one line, the right code.
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"run", "--template", "nope", "--", "true"}, 66, "nope"},
		{[]string{"template", "inspect", "nope"}, 66, "nope"},
		{[]string{"template", "rm", "nope"}, 66, "nope"},
		{[]string{"template", "import", "/no/such/file.tar", "x"}, 64, "/no/such/file.tar"},
		{[]string{"template", "import", tarPath, "../evil"}, 64, "../evil"},
		{[]string{"template", "import", tarPath, "host"}, 64, "host"},
		{[]string{"template", "import", "/etc/hostname", "x"}, 64, ""},
		{[]string{"template", "build", "."}, 64, "CONTEXT NAME"},
	} {
		r := e.cageEnv(nil, env, c.args...)
		if r.code != c.code || !strings.Contains(r.stderr, c.want) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("cage %s: %v; want exit %d and one line naming %q", strings.Join(c.args, " "), r, c.code, c.want)
		}
	}
	for _, name := range []string{"bb", "bb2"} {
		if r = e.cageEnv(nil, env, "template", "rm", name); r.code != 0 {
			t.Errorf("template rm %s: %v", name, r)
		}
	}
	r = e.cageEnv(nil, env, "template", "ls", "--json")
	if r.code != 0 || strings.TrimSpace(r.stdout) != "[]" {
		t.Errorf("template ls --json after rm: %v", r)
	}
	ents, _ := os.ReadDir(filepath.Join(data, "templates", "layers"))
	if len(ents) != 0 {
		t.Errorf("layers left after every template is removed: %v", ents)
	}
}

// layers is the "layers" list of `template inspect` output.
func layers(inspect string) string {
	i := strings.Index(inspect, `"layers"`)
	if i < 0 {
		return ""
	}
	j := strings.Index(inspect[i:], "]")
	return inspect[i : i+j]
}

// TestTemplateExportPlantedLinks: `cage template export -o FILE`, run by
// root, writes into a directory another user may write (/tmp, a shared
// one), where that user planted links at FILE and at the name a
// half-written export used to have (FILE.partial). Neither link is
// followed: the files they point at are untouched, and FILE is the export.
// Found by review, 2026-12-03: a user's /tmp/out.tar.partial -> a root
// file had root's export overwrite that file with the tarball.
func TestTemplateExportPlantedLinks(t *testing.T) {
	e := setup(t)
	env := []string{"CAGE_DATA=" + t.TempDir()}
	tarPath := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")
	if r := e.cageEnv(nil, env, "template", "import", tarPath, "bb"); r.code != 0 {
		t.Fatalf("template import: %v", r)
	}
	shared, victims := t.TempDir(), t.TempDir()
	if err := os.Chmod(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(shared, "bb.tar")
	for _, name := range []string{out, out + ".partial"} {
		victim := filepath.Join(victims, filepath.Base(name))
		if err := os.WriteFile(victim, []byte("root's own\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(victim, name); err != nil {
			t.Fatal(err)
		}
	}
	if r := e.cageEnv(nil, env, "template", "export", "bb", "-o", out); r.code != 0 {
		t.Fatalf("template export: %v", r)
	}
	for _, name := range []string{out, out + ".partial"} {
		if b, err := os.ReadFile(filepath.Join(victims, filepath.Base(name))); err != nil || string(b) != "root's own\n" {
			t.Errorf("the file %s's link pointed at: %d bytes, %v; want it untouched", filepath.Base(name), len(b), err)
		}
	}
	if fi, err := os.Lstat(out); err != nil || !fi.Mode().IsRegular() || fi.Size() < 1<<20 {
		t.Fatalf("export wrote %v, %v; want a regular file", fi, err)
	}
	if left, _ := filepath.Glob(filepath.Join(shared, ".bb.tar.partial-*")); len(left) != 0 {
		t.Errorf("left behind: %v", left)
	}
}
