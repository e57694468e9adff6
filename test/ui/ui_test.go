// Package uitest drives cage's dashboard (internal/ui) in a real browser:
// Debian's chromium, driven by playwright-core from npm (package.json
// pins it; scripts/test.sh runs `npm ci` here), against real `cage serve`
// daemons. ui.test.mjs holds the steps; this file starts the daemons, makes
// the keys and another team's sandbox, runs node, and checks afterwards
// what the daemon itself says (the API, the audit trail).
//
// Screenshots of every page go to $CAGE_UI_ARTIFACTS, default
// test/ui/artifacts (ignored by git), with results.json (page load times
// measured in the browser).
package uitest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// maxUpload is the first daemon's ui.max_upload: the suite uploads one
// byte more and must be refused.
const maxUpload = 1 << 20

// results is what ui.test.mjs writes to results.json.
type results struct {
	Created  string             `json:"created"`
	LoadMs   map[string]float64 `json:"loadMs"`
	Passed   []string           `json:"passed"`
	Viewport map[string]string  `json:"screenshots"`
}

// TestDashboard runs every step of issue 19's "How it is checked" list in
// the browser (ui.test.mjs), then checks with the API that the sandbox the
// UI made and killed is gone, that the other key's sandbox was not touched,
// and that the audit trail has the UI's create and kill as the first key's
// own API calls.
func TestDashboard(t *testing.T) {
	dir, chromium := requireBrowser(t)
	cfg := filepath.Join(t.TempDir(), "cage.json")
	conf := map[string]any{"ui": map[string]any{"max_upload": fmt.Sprint(maxUpload)}}
	expectTemplate := "host"
	// The template the suite builds from the page (FROM base where the
	// store has it), removed from the shared store afterwards.
	buildName := fmt.Sprintf("ui-build-%d", time.Now().UnixNano()%1_000_000_000)
	if store := os.Getenv("CAGE_TEMPLATES"); store != "" && os.Getenv("CAGE_REQUIRE_BASE") != "" {
		conf["templates"], expectTemplate = store, "base" // the templates page shows base's layers
		t.Cleanup(func() {
			if s, err := imgstore.Open(store); err == nil {
				_ = s.Remove(buildName)
			}
		})
	}
	writeJSON(t, cfg, conf)
	d := cageserve.Start(t, "--config", cfg)
	other := d.NewKey(t, "other-tenant")
	admin := d.NewKeyIn(t, "ui-admin", "admin")
	theirs := d.Create(t, other, map[string]any{"timeout": 600, "metadata": map[string]string{"owner": "other"}})

	shortCfg := filepath.Join(t.TempDir(), "short.json")
	writeJSON(t, shortCfg, map[string]any{"ui": map[string]any{"session_idle": "2s"}})
	short := cageserve.Start(t, "--config", shortCfg)

	artifacts := os.Getenv("CAGE_UI_ARTIFACTS")
	if artifacts == "" {
		artifacts = filepath.Join(dir, "artifacts")
	}
	if err := os.MkdirAll(artifacts, 0o755); err != nil {
		t.Fatal(err)
	}
	_ = os.Remove(filepath.Join(artifacts, "results.json"))
	env := append(os.Environ(), "CAGE_UI_URL=http://"+d.API, "CAGE_UI_KEY="+d.Key, "CAGE_UI_ADMIN_KEY="+admin,
		"CAGE_UI_OTHER_SANDBOX="+theirs.SandboxID, "CAGE_UI_SHORT_URL=http://"+short.API, "CAGE_UI_SHORT_KEY="+short.Key,
		"CAGE_UI_ARTIFACTS="+artifacts, "CAGE_UI_TEMPLATE="+expectTemplate, "CAGE_UI_BUILD="+buildName, "CAGE_UI_CHROMIUM="+chromium, fmt.Sprintf("CAGE_UI_MAX_UPLOAD=%d", maxUpload))
	if err := runNode(t, dir, env, 4*time.Minute, "--test", "--test-reporter=spec", "--test-concurrency=1", "ui.test.mjs"); err != nil {
		t.Errorf("the browser suite failed: %v (screenshots in %s; the daemon's log follows the test)", err, artifacts)
	}
	var res results
	b, err := os.ReadFile(filepath.Join(artifacts, "results.json"))
	if err != nil || json.Unmarshal(b, &res) != nil || res.Created == "" {
		t.Fatalf("results.json missing or without the sandbox the UI created: %v %s", err, b)
	}
	pages := slices.Sorted(maps.Keys(res.LoadMs))
	for _, page := range pages {
		t.Logf("page load in the browser: %s %.1f ms", page, res.LoadMs[page])
	}
	t.Logf("screenshots: %s", artifacts)

	// The UI's sandbox is gone, killed from the UI; the other key's runs on.
	if st, body, _ := d.Do(http.MethodGet, "/sandboxes/"+res.Created, d.Key, nil); st != http.StatusNotFound {
		t.Errorf("the sandbox the UI killed: GET answers %d %s, want 404", st, body)
	}
	if st, body, _ := d.Do(http.MethodGet, "/sandboxes/"+theirs.SandboxID, other, nil); st != http.StatusOK || !bytes.Contains(body, []byte(`"running"`)) {
		t.Errorf("the other key's sandbox after the suite: %d %s, want it running", st, body)
	}
	// The UI acted as the key: its create and kill are the key's API calls.
	st, body, _ := d.Do(http.MethodGet, "/audit?kind=api&sandboxID="+res.Created+"&limit=1000", d.Key, nil)
	if st != http.StatusOK || !bytes.Contains(body, []byte(`"DELETE /sandboxes/{sandboxID}"`)) {
		t.Errorf("the audit trail of the UI's sandbox (key A) lacks its kill: %d %s", st, body)
	}
	st, body, _ = d.Do(http.MethodGet, "/audit?kind=api&limit=1000", d.Key, nil)
	var calls struct {
		Entries []struct {
			Route  string `json:"route"`
			Status int    `json:"status"`
		} `json:"entries"`
	}
	if st != http.StatusOK || json.Unmarshal(body, &calls) != nil {
		t.Fatalf("GET /audit (key A): %d %s", st, body)
	}
	for _, want := range []string{"POST /v2/sandboxes 201", "POST /ui/session 200", "DELETE /ui/session 204"} {
		found := false
		for _, e := range calls.Entries {
			found = found || fmt.Sprintf("%s %d", e.Route, e.Status) == want
		}
		if !found {
			t.Errorf("the audit trail (key A) lacks %q (the UI's create, sign-in, sign-out): %s", want, body)
		}
	}
	// Of the other key's sandbox, the first key's trail holds only its own
	// refused attempts (the suite's 404s), nothing the other key did.
	st, body, _ = d.Do(http.MethodGet, "/audit?sandboxID="+theirs.SandboxID+"&limit=1000", d.Key, nil)
	var page struct {
		Entries []struct {
			Kind   string `json:"kind"`
			Status int    `json:"status"`
			Route  string `json:"route"`
		} `json:"entries"`
	}
	if st != http.StatusOK || json.Unmarshal(body, &page) != nil || len(page.Entries) == 0 {
		t.Fatalf("the first key's entries about the other key's sandbox: %d %s (want its own 404s)", st, body)
	}
	for _, e := range page.Entries {
		if e.Kind != "api.call" || e.Status != http.StatusNotFound {
			t.Errorf("the first key's trail shows the other key's sandbox: %+v", e)
		}
	}
}

// requireBrowser is test/ui with its npm packages, and Debian's chromium;
// it skips without them unless CAGE_REQUIRE_UI is set (scripts/test.sh
// sets it where it installed them).
func requireBrowser(t *testing.T) (dir, chromium string) {
	t.Helper()
	testutil.RequireRoot(t)
	dir = filepath.Join(testutil.RepoRoot(), "test", "ui")
	missing := func(format string, args ...any) {
		t.Helper()
		if os.Getenv("CAGE_REQUIRE_UI") != "" {
			t.Fatalf(format, args...)
		}
		t.Skipf(format, args...)
	}
	chromium = os.Getenv("CAGE_UI_CHROMIUM")
	if chromium == "" {
		chromium = "/usr/bin/chromium"
	}
	if _, err := os.Stat(chromium); err != nil {
		missing("Debian's chromium is not installed (apt-get install chromium; scripts/test.sh does)")
	}
	if _, err := exec.LookPath("node"); err != nil {
		missing("node is not installed")
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "playwright-core", "package.json")); err != nil {
		missing("test/ui/node_modules is missing: run `npm ci` in test/ui (scripts/test.sh does)")
	}
	return dir, chromium
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// runNode runs node ARGS in dir, logging its output line by line as it
// comes, and returns its failure.
func runNode(t *testing.T, dir string, env []string, limit time.Duration, args ...string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", args...)
	cmd.Dir, cmd.Env, cmd.WaitDelay = dir, env, 5*time.Second
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return err
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		t.Log(strings.TrimRight(sc.Text(), "\r"))
	}
	return cmd.Wait()
}
