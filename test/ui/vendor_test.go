package uitest

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/cagehq/cage/internal/testutil"
)

// vendored are the files `make ui` copies from the pinned npm packages into
// the dashboard's embedded assets: package, file in the package, copy.
var vendored = []struct{ pkg, file, copy string }{
	{"@xterm/xterm", "lib/xterm.js", "xterm.js"},
	{"@xterm/xterm", "css/xterm.css", "xterm.css"},
	{"@xterm/addon-fit", "lib/addon-fit.js", "addon-fit.js"},
}

// TestVendoredXterm: the xterm.js files embedded in the binary are those
// of the releases package.json pins, byte for byte, as `npm ci` installs
// them (a stale or edited copy fails: run `make ui`).
func TestVendoredXterm(t *testing.T) {
	dir := filepath.Join(testutil.RepoRoot(), "test", "ui")
	modules := filepath.Join(dir, "node_modules")
	if _, err := os.Stat(filepath.Join(modules, "@xterm", "xterm", "package.json")); err != nil {
		if os.Getenv("CAGE_REQUIRE_UI") != "" {
			t.Fatal("test/ui/node_modules is missing: run `npm ci` in test/ui (scripts/test.sh does)")
		}
		t.Skip("test/ui/node_modules is missing: run `npm ci` in test/ui")
	}
	var pinned struct {
		Dependencies map[string]string `json:"dependencies"`
	}
	if b, err := os.ReadFile(filepath.Join(dir, "package.json")); err != nil || json.Unmarshal(b, &pinned) != nil {
		t.Fatalf("test/ui/package.json: %v", err)
	}
	for _, v := range vendored {
		var installed struct {
			Version string `json:"version"`
		}
		b, err := os.ReadFile(filepath.Join(modules, v.pkg, "package.json"))
		if err != nil || json.Unmarshal(b, &installed) != nil {
			t.Fatalf("%s: %v", v.pkg, err)
		}
		if installed.Version != pinned.Dependencies[v.pkg] {
			t.Errorf("%s: node_modules has %s, package.json pins %q: run npm ci in test/ui", v.pkg, installed.Version, pinned.Dependencies[v.pkg])
		}
		want, err := os.ReadFile(filepath.Join(modules, v.pkg, v.file))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(testutil.RepoRoot(), "internal", "ui", "static", "vendor", v.copy))
		if err != nil {
			t.Fatalf("internal/ui/static/vendor/%s: %v (run make ui)", v.copy, err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("internal/ui/static/vendor/%s differs from %s@%s's %s: run make ui", v.copy, v.pkg, installed.Version, v.file)
		}
	}
}
