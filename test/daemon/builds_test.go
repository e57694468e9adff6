package daemontest

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/testutil"
)

// adminKey makes an admin key for d on the host.
func (d *daemon) adminKey(t *testing.T) string {
	t.Helper()
	r := d.cli(t, "", "keys", "create", "--admin", "--name", "builder", "--data", d.data)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || !keyRE.MatchString(lines[len(lines)-1]) {
		t.Fatalf("cage keys create --admin: %v", r)
	}
	return lines[len(lines)-1]
}

// followBuild reads a build's log by long poll until it ends, and returns
// the build and every byte of its log.
func (d *daemon) followBuild(t *testing.T, key, id string) (types.TemplateBuild, string) {
	t.Helper()
	var text strings.Builder
	var off int64
	for deadline := time.Now().Add(3 * time.Minute); ; {
		var l types.TemplateBuildLog
		d.expect(t, http.StatusOK, call{method: "GET", path: fmt.Sprintf("/admin/templates/builds/%s/log?offset=%d&wait=10", id, off), key: key}).decode(t, &l)
		if l.Offset != off || l.Truncated {
			t.Fatalf("the log from %d came from %d (truncated %v): a small log is kept whole", off, l.Offset, l.Truncated)
		}
		text.WriteString(l.Text)
		off = l.Next
		if l.State != types.TemplateBuildLogStateBuilding {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("build %s still building after 3 minutes; log so far:\n%s", id, text.String())
		}
	}
	var b types.TemplateBuild
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/templates/builds/" + id, key: key}).decode(t, &b)
	if b.Log != text.String() || b.LogOffset != 0 {
		t.Errorf("GET build's log (from %d) differs from the followed log:\n%q\n%q", b.LogOffset, b.Log, text.String())
	}
	return b, text.String()
}

func startBuild(t *testing.T, d *daemon, key, name string, body map[string]any) types.TemplateBuild {
	t.Helper()
	var b types.TemplateBuild
	d.expect(t, http.StatusAccepted, call{method: "POST", path: "/admin/templates/" + name + "/builds", key: key, body: body}).decode(t, &b)
	if !strings.HasPrefix(b.BuildID, "build_") || b.Template != name || b.State != types.TemplateBuildStateBuilding {
		t.Fatalf("the build started: %+v", b)
	}
	return b
}

// TestTemplateBuildRefusals: what the build route refuses, each before
// anything runs, on a daemon whose store holds no base: a tenant key 403
// before its (oversized) body is read, no key 401, COPY and ADD 400
// naming their lines, a Dockerfile over 64 KiB 413, a bad name, network
// or Dockerfile 400; FROM a template the store lacks, and FROM
// debian:bookworm (which would download Debian on the host), fail saying
// why; an unknown build 404.
func TestTemplateBuildRefusals(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	admin := d.adminKey(t)
	route := "/admin/templates/refused/builds"
	huge := []byte(`{"dockerfile":"` + strings.Repeat("A", 200<<10) + `"}`)
	r := d.expect(t, http.StatusForbidden, call{method: "POST", path: route, key: d.key, body: huge, invalid: true})
	if !strings.Contains(string(r.body), "admin key") {
		t.Errorf("a tenant key's 403 says why: %v", r)
	}
	d.expect(t, http.StatusUnauthorized, call{method: "POST", path: route, body: map[string]any{"dockerfile": "FROM base"}})
	for _, c := range []struct {
		name string
		body any
		want int
		text string
	}{
		{"copy", map[string]any{"dockerfile": "FROM base\nRUN true\nCOPY /etc/shadow /x\n"}, 400, "COPY on line 3"},
		{"add", map[string]any{"dockerfile": "FROM base\nADD secrets /x\n"}, 400, "ADD on line 2"},
		{"both", map[string]any{"dockerfile": "FROM base\ncopy a /a\nADD b /b\n"}, 400, "COPY on line 2, ADD on line 3"},
		{"oversized", map[string]any{"dockerfile": "FROM base\nRUN true #" + strings.Repeat("x", 64<<10)}, 413, "65536 bytes"},
		{"oversized body", huge, 413, "65536 bytes"},
		{"no FROM", map[string]any{"dockerfile": "RUN true\n"}, 400, "FROM"},
		{"empty", map[string]any{"dockerfile": ""}, 400, "no instructions"},
		{"unsupported", map[string]any{"dockerfile": "FROM base\nHEALTHCHECK CMD true\n"}, 400, "HEALTHCHECK"},
		{"network", map[string]any{"dockerfile": "FROM base\n", "network": "bridge"}, 400, "network"},
		{"arg name", map[string]any{"dockerfile": "FROM base\n", "buildArgs": map[string]string{"A=B": "c"}}, 400, "ARG name"},
		{"not JSON", []byte("FROM base\n"), 400, "malformed JSON"},
	} {
		r := d.do(t, call{method: "POST", path: route, key: admin, body: c.body, invalid: true})
		if r.status != c.want || !strings.Contains(string(r.body), c.text) {
			t.Errorf("%s: %v, want %d naming %q", c.name, r, c.want, c.text)
		}
	}
	for _, name := range []string{"Upper", "host", "a..b"} {
		r := d.do(t, call{method: "POST", path: "/admin/templates/" + name + "/builds", key: admin, body: map[string]any{"dockerfile": "FROM base"}})
		if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "template name") {
			t.Errorf("template name %q: %v, want 400", name, r)
		}
	}
	for _, c := range []struct{ from, text string }{
		{"nosuch", "FROM nosuch"},
		{"debian:bookworm", "may not make it"},
	} {
		b := startBuild(t, d, admin, "refused", map[string]any{"dockerfile": "FROM " + c.from + "\nRUN true\n"})
		got, log := d.followBuild(t, admin, b.BuildID)
		if got.State != types.TemplateBuildStateFailed || !strings.Contains(got.Error, c.text) || !strings.Contains(log, "build failed: ") {
			t.Errorf("FROM %s: %+v, want failed naming %q; log:\n%s", c.from, got, c.text, log)
		}
	}
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/admin/templates/builds/build_nosuch", key: admin})
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/admin/templates/builds/build_nosuch/log", key: admin})
	d.expect(t, http.StatusForbidden, call{method: "GET", path: "/admin/templates/builds", key: d.key})
	var list []types.TemplateBuild
	d.expect(t, http.StatusOK, call{method: "GET", path: "/admin/templates/builds", key: admin}).decode(t, &list)
	if len(list) != 2 || list[0].State != types.TemplateBuildStateFailed {
		t.Errorf("the builds kept: %+v, want the 2 failed ones", list)
	}
}

// TestTemplateBuild: an admin key builds a template through the API from
// the shared store's base (`RUN echo $GREETING > /hello`, the ARG given as
// a build argument), follows its log by
// long poll (the step lines and the RUN's own output appear), a second
// build while it runs is 409, the template is in the store and a sandbox
// made from it reads /hello; a RUN that fails (in a build with the
// internet, which its log says) makes a failed build that says which step
// and why; the audit trail has the admin key's
// template.build and template.built; a daemon stopped during a build ends
// it and leaves no sandbox.
func TestTemplateBuild(t *testing.T) {
	t.Parallel()
	store := os.Getenv("CAGE_TEMPLATES")
	if store == "" {
		if os.Getenv("CAGE_REQUIRE_BASE") != "" {
			t.Fatal("CAGE_REQUIRE_BASE is set but CAGE_TEMPLATES names no store")
		}
		t.Skip("CAGE_TEMPLATES names no store with base")
	}
	d := startDaemon(t, "--config", templatesConfig(t))
	admin := d.adminKey(t)
	nonce := make([]byte, 6)
	_, _ = rand.Read(nonce)
	name := "apibuild-" + hex.EncodeToString(nonce)
	t.Cleanup(func() {
		if s, err := imgstore.Open(store); err == nil {
			_ = s.Remove(name)
		}
	})
	// The nonce makes the step new to the shared store's build cache.
	df := fmt.Sprintf("FROM base\nARG GREETING\nRUN echo $GREETING > /hello && echo out-%s && echo err-%s >&2\n", name, name)
	b := startBuild(t, d, admin, name, map[string]any{"dockerfile": df, "buildArgs": map[string]string{"GREETING": "hi"}})
	if b.Network != types.TemplateBuildNetworkNone {
		t.Errorf("a build that names no network: %q, want none", b.Network)
	}
	r := d.expect(t, http.StatusConflict, call{method: "POST", path: "/admin/templates/other/builds", key: admin,
		body: map[string]any{"dockerfile": "FROM base\n"}})
	if !strings.Contains(string(r.body), b.BuildID) {
		t.Errorf("the 409 names the running build %s: %v", b.BuildID, r)
	}
	got, log := d.followBuild(t, admin, b.BuildID)
	if got.State != types.TemplateBuildStateSucceeded || got.Error != "" || !strings.HasPrefix(got.TemplateID, "sha256:") || got.FinishedAt.IsZero() {
		t.Fatalf("the build: %+v; log:\n%s", got, log)
	}
	for _, want := range []string{"step 1/3: FROM base", "step 3/3: RUN echo $GREETING", "out-" + name + "\n", "err-" + name + "\n", "built template " + name} {
		if !strings.Contains(log, want) {
			t.Errorf("the log lacks %q:\n%s", want, log)
		}
	}
	sb := d.create(t, d.key, map[string]any{"templateID": name})
	if out := mustRun(t, d.agent(sb.SandboxID, sb.EnvdAccessToken), "cat /hello"); out != "hi\n" {
		t.Errorf("/hello in a sandbox of the built template: %q", out)
	}
	d.kill(t, d.key, sb.SandboxID)

	fail := startBuild(t, d, admin, name+"-x", map[string]any{"dockerfile": "FROM base\nRUN echo before-fail && exit 3\n", "network": "internet"})
	got, log = d.followBuild(t, admin, fail.BuildID)
	if got.State != types.TemplateBuildStateFailed || !strings.Contains(got.Error, "step 2/2") || !strings.Contains(got.Error, "exit code 3") ||
		!strings.Contains(log, "before-fail") || got.Network != types.TemplateBuildNetworkInternet || !strings.Contains(log, "with network: internet") {
		t.Errorf("a failing RUN: %+v; log:\n%s", got, log)
	}
	if s, err := imgstore.Open(store); err != nil {
		t.Fatal(err)
	} else if _, err := s.Get(name + "-x"); err == nil {
		t.Errorf("a failed build left template %s-x", name)
	}

	var page types.AuditPage
	d.expect(t, http.StatusOK, call{method: "GET", path: "/audit?kind=template", key: admin}).decode(t, &page)
	kinds := map[string]int{}
	for _, e := range page.Entries {
		detail, _ := json.Marshal(e.Detail)
		if strings.Contains(string(detail), b.BuildID) {
			kinds[e.Kind]++
		}
	}
	if kinds["template.build"] != 1 || kinds["template.built"] != 1 {
		t.Errorf("the admin key's trail for build %s: %v, want one template.build and one template.built (%+v)", b.BuildID, kinds, page.Entries)
	}

	// A daemon stopped during a build ends it: a clean exit within the
	// harness's 10 s, the RUN step's sandbox gone, no template made.
	slow := startBuild(t, d, admin, name+"-slow", map[string]any{"dockerfile": "FROM base\nRUN echo sleeping && sleep 300\n"})
	var off int64
	for deadline := time.Now().Add(time.Minute); ; {
		var l types.TemplateBuildLog
		d.expect(t, http.StatusOK, call{method: "GET", path: fmt.Sprintf("/admin/templates/builds/%s/log?offset=%d&wait=5", slow.BuildID, off), key: admin}).decode(t, &l)
		off = l.Next
		if strings.Contains(l.Text, "sleeping\n") {
			break
		}
		if l.State != types.TemplateBuildLogStateBuilding || time.Now().After(deadline) {
			t.Fatalf("the slow build's RUN did not start: %+v", l)
		}
	}
	if len(d.sandboxDirs()) == 0 {
		t.Error("no sandbox on the host while a RUN step runs")
	}
	d.stop(t)
	if left := d.sandboxDirs(); len(left) != 0 {
		t.Errorf("sandboxes left on the host by a build the daemon's stop ended: %v", left)
	}
	if s, err := imgstore.Open(store); err != nil {
		t.Fatal(err)
	} else if _, err := s.Get(name + "-slow"); err == nil {
		t.Errorf("a build ended by the daemon's stop made template %s-slow", name)
	}
}

// TestTemplateBuildCancelAndStepTimeout: a build's RUN step past the
// request's stepTimeout is stopped by the host, and the build fails
// naming the limit; DELETE of a running build (admin keys only: a tenant
// key 403, and the build runs on) stops it, answering the ended build,
// failed and saying who cancelled it; a DELETE of an ended build is 409,
// of an unknown one 404; a bad stepTimeout is 400. Each leaves no sandbox
// on the host and no template. Before, a step ran as long as it liked and
// nothing but the daemon's stop ended a build.
func TestTemplateBuildCancelAndStepTimeout(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	admin := d.adminKey(t)
	tarPath := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")
	if r := d.cli(t, "", "template", "import", "--data", d.data, tarPath, "bb"); r.code != 0 {
		t.Fatalf("import: %v", r)
	}
	noTemplate := func(name string) {
		t.Helper()
		if left := d.sandboxDirs(); len(left) != 0 {
			t.Errorf("sandboxes left on the host after build of %s: %v", name, left)
		}
		if r := d.cli(t, "", "template", "inspect", "--data", d.data, name); r.code == 0 {
			t.Errorf("build of %s made its template", name)
		}
	}
	for _, bad := range []any{0.5, -1, 86401, 1 << 62, "60"} {
		r := d.do(t, call{method: "POST", path: "/admin/templates/bad/builds", key: admin, invalid: true,
			body: map[string]any{"dockerfile": "FROM bb\n", "stepTimeout": bad}})
		if r.status != http.StatusBadRequest {
			t.Errorf("stepTimeout %v: %v, want 400", bad, r)
		}
	}

	// The step's limit.
	b := startBuild(t, d, admin, "slow", map[string]any{"dockerfile": "FROM bb\nRUN echo sleeping && sleep 300\n", "stepTimeout": 2})
	if b.StepTimeout != 2 {
		t.Errorf("the build's step limit: %d, want 2", b.StepTimeout)
	}
	start := time.Now()
	got, log := d.followBuild(t, admin, b.BuildID)
	if got.State != types.TemplateBuildStateFailed || !strings.Contains(got.Error, "step 2/2") ||
		!strings.Contains(got.Error, "ran past its time limit of 2s") || !strings.Contains(log, "sleeping\n") {
		t.Errorf("a RUN past its 2 s: %+v; log:\n%s", got, log)
	}
	if took := time.Since(start); took > time.Minute {
		t.Errorf("the step ran %v past a limit of 2 s", took)
	}
	noTemplate("slow")

	// A cancel.
	b = startBuild(t, d, admin, "cancelled", map[string]any{"dockerfile": "FROM bb\nRUN echo sleeping && sleep 300\n"})
	if b.StepTimeout != 3600 {
		t.Errorf("the default step limit: %d, want 3600", b.StepTimeout)
	}
	var off int64
	for deadline := time.Now().Add(time.Minute); ; {
		var l types.TemplateBuildLog
		d.expect(t, http.StatusOK, call{method: "GET", path: fmt.Sprintf("/admin/templates/builds/%s/log?offset=%d&wait=5", b.BuildID, off), key: admin}).decode(t, &l)
		off = l.Next
		if strings.Contains(l.Text, "sleeping\n") {
			break
		}
		if l.State != types.TemplateBuildLogStateBuilding || time.Now().After(deadline) {
			t.Fatalf("the build's RUN did not start: %+v", l)
		}
	}
	if len(d.sandboxDirs()) == 0 {
		t.Error("no sandbox on the host while a RUN step runs")
	}
	route := "/admin/templates/builds/" + b.BuildID
	d.expect(t, http.StatusForbidden, call{method: "DELETE", path: route, key: d.key})
	d.expect(t, http.StatusUnauthorized, call{method: "DELETE", path: route})
	var still types.TemplateBuild
	d.expect(t, http.StatusOK, call{method: "GET", path: route, key: admin}).decode(t, &still)
	if still.State != types.TemplateBuildStateBuilding {
		t.Fatalf("a tenant's DELETE ended the build: %+v", still)
	}
	start = time.Now()
	d.expect(t, http.StatusOK, call{method: "DELETE", path: route, key: admin}).decode(t, &got)
	if got.State != types.TemplateBuildStateFailed || !strings.Contains(got.Error, "cancelled by key") || got.FinishedAt.IsZero() {
		t.Errorf("the cancelled build: %+v", got)
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("the cancel took %v", took)
	}
	noTemplate("cancelled")
	r := d.expect(t, http.StatusConflict, call{method: "DELETE", path: route, key: admin})
	if !strings.Contains(string(r.body), "has ended") {
		t.Errorf("a second DELETE: %v", r)
	}
	d.expect(t, http.StatusNotFound, call{method: "DELETE", path: "/admin/templates/builds/build_nosuch", key: admin})
	// The next build runs (the one at a time was let go).
	b = startBuild(t, d, admin, "after", map[string]any{"dockerfile": "FROM bb\nRUN echo made > /made\n"})
	if got, log := d.followBuild(t, admin, b.BuildID); got.State != types.TemplateBuildStateSucceeded {
		t.Errorf("a build after the cancel: %+v; log:\n%s", got, log)
	}
	if left := d.sandboxDirs(); len(left) != 0 {
		t.Errorf("sandboxes left on the host: %v", left)
	}
}

// TestBuildStepTemplateIsTheBuildsOwn: a RUN step's sandbox is made from
// an ephemeral template of the daemon's host (build-XXXXXXXXXXXX), whose
// name the step reads in its own /proc/self/mountinfo. A tenant told that
// name by a hostile step (RUN curl ... | sh) asks for a sandbox of it
// while the step runs. Expected: the same 404 as for a template that
// never existed. Before, it got a sandbox of the build's image so far,
// as a build sandbox (root keeping CAP_SETUID, CAP_DAC_OVERRIDE... in
// its namespace), outside any build.
func TestBuildStepTemplateIsTheBuildsOwn(t *testing.T) {
	t.Parallel()
	d := startDaemon(t)
	admin := d.adminKey(t)
	tarPath := testutil.WriteDockerArchive(t, testutil.TestImage(t), "cage-test:latest")
	if r := d.cli(t, "", "template", "import", "--data", d.data, tarPath, "bb"); r.code != 0 {
		t.Fatalf("import: %v", r)
	}
	b := startBuild(t, d, admin, "leaky", map[string]any{"stepTimeout": 120,
		"dockerfile": "FROM bb\nRUN echo \"name=$(grep -o 'cage-template:build-[0-9a-f]*' /proc/self/mountinfo | head -1 | cut -d: -f2)\" && sleep 300\n"})
	var off int64
	var name string
	for deadline := time.Now().Add(time.Minute); name == ""; {
		var l types.TemplateBuildLog
		d.expect(t, http.StatusOK, call{method: "GET", path: fmt.Sprintf("/admin/templates/builds/%s/log?offset=%d&wait=5", b.BuildID, off), key: admin}).decode(t, &l)
		off = l.Next
		if _, rest, ok := strings.Cut(l.Text, "name=build-"); ok { // (the step's own line has name=$(...)
			rest = "build-" + rest
			name, _, _ = strings.Cut(rest, "\n")
		}
		if name == "" && (l.State != types.TemplateBuildLogStateBuilding || time.Now().After(deadline)) {
			t.Fatalf("the step did not say its template's name: %+v", l)
		}
	}
	if !strings.HasPrefix(name, "build-") {
		t.Fatalf("the step's template is %q, want build-...", name)
	}
	ask := func(tmpl string) reply {
		return d.do(t, call{method: "POST", path: "/v2/sandboxes", key: d.key, body: map[string]any{"templateID": tmpl, "timeout": 60}})
	}
	got, never := ask(name), ask("build-000000000000")
	if got.status == http.StatusCreated {
		var sb types.Sandbox
		got.decode(t, &sb)
		t.Errorf("a tenant made sandbox %s of the running step's template %s", sb.SandboxID, name)
		d.kill(t, d.key, sb.SandboxID)
	}
	if got.status != never.status || strings.ReplaceAll(string(got.body), name, "build-000000000000") != string(never.body) {
		t.Errorf("the step's template %s: %v; want the answer of a template that never existed: %v", name, got, never)
	}
	var ended types.TemplateBuild
	d.expect(t, http.StatusOK, call{method: "DELETE", path: "/admin/templates/builds/" + b.BuildID, key: admin}).decode(t, &ended)
	if left := d.sandboxDirs(); len(left) != 0 {
		t.Errorf("sandboxes left on the host: %v", left)
	}
}
