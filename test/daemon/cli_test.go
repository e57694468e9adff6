package daemontest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// Exit codes of cage itself (internal/cli/cli.go).
const (
	exitUsage       = 64
	exitNotFoundObj = 66
	exitUnavailable = 69
	exitNoPerm      = 77
	exitNotFound    = 127
)

// cliResult is how one cage invocation went.
type cliResult struct {
	stdout, stderr string
	code           int
}

func (r cliResult) String() string {
	return fmt.Sprintf("exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
}

// cli runs the cage CLI as the daemon's client (CAGE_HOST, CAGE_PROXY_URL,
// CAGE_API_KEY), stdin /dev/null, and checks it printed no stack trace.
func (d *daemon) cli(t *testing.T, key string, args ...string) cliResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := d.cageCmd(ctx, []string{"CAGE_HOST=" + d.apiURL(), "CAGE_PROXY_URL=" + d.proxyURL(), "CAGE_API_KEY=" + key}, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	r := cliResult{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			t.Errorf("cage %s was killed by %v", strings.Join(args, " "), ws.Signal())
		}
		r.code = ee.ExitCode()
	default:
		t.Fatalf("cage %s: %v", strings.Join(args, " "), err)
	}
	t.Logf("cage %s: %v", strings.Join(args, " "), tail(r.String(), 2000))
	noStack(t, "cage "+strings.Join(args, " ")+" stderr", r.stderr)
	return r
}

// oneLine checks that stderr is exactly one line starting with "cage: " and
// mentioning each of want.
func oneLine(t *testing.T, what, stderr string, want ...string) {
	t.Helper()
	if !strings.HasPrefix(stderr, "cage: ") || !strings.HasSuffix(stderr, "\n") || strings.Count(stderr, "\n") != 1 {
		t.Errorf("%s: stderr must be one line starting with \"cage: \", got %q", what, stderr)
	}
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			t.Errorf("%s: stderr %q does not mention %q", what, stderr, w)
		}
	}
}

// TestCLI drives the daemon with the cage CLI: create, ls, exec, inspect,
// cp both ways (and from a hostile sandbox), rm, and the answers when the
// sandbox or the daemon is gone.
func TestCLI(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--pool", "2")
	key := d.key

	r := d.cli(t, key, "create", "--json", "--timeout", "5m", "--memory", "256M", "--env", "GREETING=hello cli", "--metadata", "from=cli")
	var sb types.SandboxDetail
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &sb) != nil || sb.SandboxID == "" {
		t.Fatalf("cage create --json: %v; want JSON with a sandboxID", r)
	}
	d.remember(sb.SandboxID, key)
	id := sb.SandboxID
	truthful(t, "cage create --json", r.stdout, map[string]string{"from": "cli"})
	if sb.MemoryMB != 256 {
		t.Errorf("cage create --memory 256M: memoryMB %d", sb.MemoryMB)
	}
	// Plain create prints the id alone.
	r = d.cli(t, key, "create", "--timeout", "60")
	plain := strings.TrimSpace(r.stdout)
	if r.code != 0 || plain == "" || strings.ContainsAny(plain, " \n") {
		t.Errorf("cage create: %v; want the id alone", r)
	} else {
		d.remember(plain, key)
	}

	r = d.cli(t, key, "ls")
	lines := strings.Split(strings.TrimRight(r.stdout, "\n"), "\n")
	if r.code != 0 || len(lines) < 2 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(r.stdout, id) {
		t.Errorf("cage ls: %v; want a table with a header and %s", r, id)
	}
	r = d.cli(t, key, "ls", "--json")
	var ls []types.ListedSandbox
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &ls) != nil {
		t.Errorf("cage ls --json: %v; want a JSON array", r)
	} else if ids := idsOf(ls); !sameSet(ids, []string{id, plain}) {
		t.Errorf("cage ls --json lists %v, want %s and %s", ids, id, plain)
	}
	truthful(t, "cage ls --json", r.stdout, nil)
	r = d.cli(t, key, "ls", "--json", "--metadata", "from=cli")
	if json.Unmarshal([]byte(r.stdout), &ls) != nil || !sameSet(idsOf(ls), []string{id}) {
		t.Errorf("cage ls --json --metadata from=cli: %v; want only %s", r, id)
	}

	// exec passes output and exit codes through.
	r = d.cli(t, key, "exec", id, "--", "sh", "-c", "echo hi; exit 7")
	if r.code != 7 || r.stdout != "hi\n" {
		t.Errorf("cage exec -- sh -c 'echo hi; exit 7': %v; want stdout \"hi\\n\" and exit 7", r)
	}
	r = d.cli(t, key, "exec", id, "--", "sh", "-c", "echo $GREETING; echo err >&2")
	if r.code != 0 || r.stdout != "hello cli\n" || r.stderr != "err\n" {
		t.Errorf("cage exec with the sandbox's env: %v", r)
	}
	r = d.cli(t, key, "exec", id, "--", "no-such-cmd")
	if r.code != exitNotFound || r.stdout != "" {
		t.Errorf("cage exec -- no-such-cmd: %v; want exit %d", r, exitNotFound)
	}
	oneLine(t, "cage exec -- no-such-cmd", r.stderr, "no-such-cmd")

	// inspect.
	r = d.cli(t, key, "inspect", id)
	if r.code != 0 || !strings.Contains(r.stdout, id) || !strings.Contains(r.stdout, "running") || !strings.Contains(r.stdout, "from=cli") {
		t.Errorf("cage inspect: %v", r)
	}
	r = d.cli(t, key, "inspect", "--json", id)
	var detail types.SandboxDetail
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &detail) != nil || detail.SandboxID != id || detail.State != "running" ||
		detail.Metadata["from"] != "cli" || detail.MemoryMB != 256 {
		t.Errorf("cage inspect --json: %v", r)
	}

	t.Run("cp file", func(t *testing.T) {
		dir := t.TempDir()
		src := filepath.Join(dir, "data.bin")
		data := make([]byte, 1<<20+123)
		_, _ = rand.Read(data)
		if err := os.WriteFile(src, data, 0o644); err != nil {
			t.Fatal(err)
		}
		if r := d.cli(t, key, "cp", src, id+":/tmp/data.bin"); r.code != 0 {
			t.Fatalf("cage cp host -> sandbox: %v", r)
		}
		back := filepath.Join(dir, "back.bin")
		if r := d.cli(t, key, "cp", id+":/tmp/data.bin", back); r.code != 0 {
			t.Fatalf("cage cp sandbox -> host: %v", r)
		}
		if got, err := os.ReadFile(back); err != nil || !bytes.Equal(got, data) {
			t.Errorf("the file copied there and back differs (%d bytes, want %d): %v", len(got), len(data), err)
		}
		// Into an existing directory, it keeps its name.
		into := filepath.Join(dir, "into")
		_ = os.Mkdir(into, 0o755)
		if r := d.cli(t, key, "cp", id+":/tmp/data.bin", into); r.code != 0 {
			t.Fatalf("cage cp sandbox -> host directory: %v", r)
		}
		if got, err := os.ReadFile(filepath.Join(into, "data.bin")); err != nil || !bytes.Equal(got, data) {
			t.Errorf("cage cp into a directory: %v", err)
		}
		// A missing file: an error, one line, nothing created.
		r := d.cli(t, key, "cp", id+":/tmp/no-such-file", filepath.Join(dir, "missing"))
		if r.code == 0 {
			t.Errorf("cage cp of a missing file: %v; want an error", r)
		}
		oneLine(t, "cage cp of a missing file", r.stderr)
		if _, err := os.Lstat(filepath.Join(dir, "missing")); err == nil {
			t.Errorf("cage cp of a missing file created the destination")
		}
	})

	t.Run("cp tree", func(t *testing.T) {
		dir := t.TempDir()
		src := filepath.Join(dir, "src")
		blob := make([]byte, 300<<10)
		_, _ = rand.Read(blob)
		files := map[string][]byte{
			"a.txt":              []byte("alpha\n"),
			"sub/b.bin":          blob,
			"sub/deeper/c.txt":   []byte("gamma\n"),
			"empty":              nil,
			"name with space.md": []byte("# spaced\n"),
		}
		for name, content := range files {
			p := filepath.Join(src, name)
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, content, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\necho ran\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		_ = os.Mkdir(filepath.Join(src, "emptydir"), 0o755)
		for link, target := range map[string]string{"link": "a.txt", "sub/up": "../a.txt", "dangling": "no/such/file"} {
			if err := os.Symlink(target, filepath.Join(src, link)); err != nil {
				t.Fatal(err)
			}
		}
		if r := d.cli(t, key, "cp", src, id+":/tmp/tree"); r.code != 0 {
			t.Fatalf("cage cp DIR sandbox: %v", r)
		}
		// It is there, usable, in the sandbox.
		if r := d.cli(t, key, "exec", id, "--", "sh", "-c", "cd /tmp/tree && ./run.sh && cat link && readlink sub/up && cat sub/deeper/c.txt"); r.code != 0 ||
			r.stdout != "ran\nalpha\n../a.txt\ngamma\n" {
			t.Errorf("the copied tree in the sandbox: %v", r)
		}
		back := filepath.Join(dir, "back")
		if r := d.cli(t, key, "cp", id+":/tmp/tree", back); r.code != 0 {
			t.Fatalf("cage cp sandbox DIR -> host: %v", r)
		}
		if diff := compareTrees(src, back); diff != "" {
			t.Errorf("the tree copied there and back differs:\n%s", diff)
		}
	})

	t.Run("cp hostile", func(t *testing.T) {
		etcBefore := snapshot(t, "/etc")
		tag := randomTag()
		canary := "cage-canary-" + tag
		outside := t.TempDir() // a host directory the sandbox may name but not write
		// A directory with a symlink to the host's /etc, one to a host
		// directory outside the destination, one up out of it, and a file.
		script := fmt.Sprintf(`set -e
mkdir -p /tmp/hostile
ln -s /etc /tmp/hostile/evil
ln -s %[1]s /tmp/hostile/out
ln -s .. /tmp/hostile/up
echo pwned > /tmp/hostile/%[2]s
for n in evil out up; do mkdir -p /tmp/then-$n/$n; echo pwned > /tmp/then-$n/$n/%[2]s; done`, outside, canary)
		if r := d.cli(t, key, "exec", id, "--", "sh", "-c", script); r.code != 0 {
			t.Fatalf("preparing the hostile directories: %v", r)
		}
		parent := t.TempDir()
		dst := filepath.Join(parent, "dst")
		r := d.cli(t, key, "cp", id+":/tmp/hostile", dst)
		if r.code != 0 {
			t.Errorf("cage cp of a directory holding symlinks: %v (symlinks are copied as symlinks)", r)
		}
		for name, want := range map[string]string{"evil": "/etc", "out": outside, "up": ".."} {
			if target, err := os.Readlink(filepath.Join(dst, name)); err != nil || target != want {
				t.Errorf("dst/%s: want a symlink to %s, got %q, %v", name, want, target, err)
			}
		}
		if b, err := os.ReadFile(filepath.Join(dst, canary)); err != nil || string(b) != "pwned\n" {
			t.Errorf("the plain file of the hostile directory: %q, %v", b, err)
		}
		// Then copies into the same destination whose entries go under the
		// names that are now symlinks: nothing may be written through them
		// (refusing is fine).
		for _, n := range []string{"evil", "out", "up"} {
			r = d.cli(t, key, "cp", id+":/tmp/then-"+n, dst)
			if r.code != 0 {
				oneLine(t, "the refused hostile copy through "+n, r.stderr)
			} else if fi, err := os.Lstat(filepath.Join(dst, n)); err != nil || !fi.IsDir() {
				t.Errorf("cage cp of then-%s succeeded, but dst/%s is not a directory of its own: %v %v", n, n, fi, err)
			}
		}
		for _, p := range []string{filepath.Join("/etc", canary), filepath.Join(outside, canary), filepath.Join(parent, canary)} {
			if _, err := os.Lstat(p); err == nil {
				t.Errorf("cage cp from a hostile sandbox wrote %s, outside the destination %s", p, dst)
				_ = os.Remove(p)
			}
		}
		if ents, _ := os.ReadDir(outside); len(ents) != 0 {
			t.Errorf("cage cp wrote into %s, outside the destination: %v", outside, ents)
		}
		if ents, _ := os.ReadDir(parent); len(ents) != 1 {
			t.Errorf("cage cp wrote beside the destination: %v", ents)
		}
		if diff := compareSnapshots(etcBefore, snapshot(t, "/etc")); diff != "" {
			t.Errorf("the host's /etc changed during the hostile copies:\n%s", diff)
		}
	})

	// rm, then the sandbox is gone for every command.
	r = d.cli(t, key, "rm", id)
	if r.code != 0 || strings.TrimSpace(r.stdout) != id {
		t.Errorf("cage rm: %v", r)
	}
	r = d.cli(t, key, "exec", id, "--", "true")
	if r.code != exitNotFoundObj {
		t.Errorf("cage exec on a removed sandbox: %v; want exit %d", r, exitNotFoundObj)
	}
	oneLine(t, "cage exec on a removed sandbox", r.stderr, id)
	for _, args := range [][]string{{"inspect", id}, {"rm", id}, {"cp", id + ":/tmp/x", t.TempDir()}} {
		r = d.cli(t, key, args...)
		if r.code != exitNotFoundObj {
			t.Errorf("cage %s on a removed sandbox: %v; want exit %d", strings.Join(args, " "), r, exitNotFoundObj)
		}
		oneLine(t, "cage "+strings.Join(args, " "), r.stderr)
	}
	d.checkGone(t, id, 5*time.Second)

	// Keys: none, and a wrong one.
	r = d.cli(t, "", "ls")
	if r.code != exitUsage {
		t.Errorf("cage ls without a key: %v; want exit %d", r, exitUsage)
	}
	oneLine(t, "cage ls without a key", r.stderr, "CAGE_API_KEY")
	r = d.cli(t, "e2b_"+strings.Repeat("0", 40), "ls")
	if r.code != exitNoPerm {
		t.Errorf("cage ls with a wrong key: %v; want exit %d", r, exitNoPerm)
	}
	oneLine(t, "cage ls with a wrong key", r.stderr)

	// The daemon stopped: one line saying so, exit 69.
	if plain != "" {
		d.cli(t, key, "rm", plain)
	}
	d.stop(t)
	for _, args := range [][]string{{"ls"}, {"ls", "--json"}, {"create"}, {"exec", id, "--", "true"}, {"inspect", id}, {"rm", id}} {
		r = d.cli(t, key, args...)
		if r.code != exitUnavailable || r.stdout != "" {
			t.Errorf("cage %s with the daemon stopped: %v; want exit %d", strings.Join(args, " "), r, exitUnavailable)
		}
		oneLine(t, "cage "+strings.Join(args, " ")+" with the daemon stopped", r.stderr, "not running")
	}
}

// truthful checks the JSON a client command prints about sandboxes (an
// object or an array of them): a field it prints must hold the sandbox's
// value, not a zero value standing for "not known" (a year-1 endAt, an empty
// state or access token, null metadata when metadata was given).
func truthful(t *testing.T, what, out string, metadata map[string]string) {
	t.Helper()
	var items []map[string]json.RawMessage
	if err := json.Unmarshal([]byte(out), &items); err != nil {
		var one map[string]json.RawMessage
		if err := json.Unmarshal([]byte(out), &one); err != nil {
			t.Errorf("%s: not JSON: %v", what, err)
			return
		}
		items = append(items, one)
	}
	for _, it := range items {
		var bad []string
		for _, f := range []string{"startedAt", "endAt"} {
			if raw, ok := it[f]; ok {
				var ts time.Time
				if json.Unmarshal(raw, &ts) != nil || ts.Year() < 2000 {
					bad = append(bad, f+" "+string(raw))
				}
			}
		}
		for f, want := range map[string]string{"state": "running"} {
			if raw, ok := it[f]; ok {
				var v string
				if json.Unmarshal(raw, &v) != nil || v != want {
					bad = append(bad, f+" "+string(raw))
				}
			}
		}
		if raw, ok := it["envdAccessToken"]; ok {
			var v string
			if json.Unmarshal(raw, &v) != nil || v == "" {
				bad = append(bad, "envdAccessToken "+string(raw))
			}
		}
		if raw, ok := it["metadata"]; ok && metadata != nil {
			var md map[string]string
			same := json.Unmarshal(raw, &md) == nil && len(md) == len(metadata)
			for k, v := range metadata {
				same = same && md[k] == v
			}
			if !same {
				bad = append(bad, "metadata "+string(raw))
			}
		}
		if len(bad) > 0 {
			t.Errorf("%s prints placeholder values as facts about sandbox %s: %s (omit what is not known, or fetch it)",
				what, it["sandboxID"], strings.Join(bad, ", "))
		}
	}
}

func randomTag() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// compareTrees describes how two directory trees differ: names, types,
// contents, symlink targets and permission bits.
func compareTrees(a, b string) string {
	ea, eb := treeOf(a), treeOf(b)
	var diff []string
	for name, x := range ea {
		y, ok := eb[name]
		switch {
		case !ok:
			diff = append(diff, "missing: "+name)
		case x != y:
			diff = append(diff, fmt.Sprintf("%s: %s, want %s", name, y, x))
		}
	}
	for name := range eb {
		if _, ok := ea[name]; !ok {
			diff = append(diff, "extra: "+name)
		}
	}
	return strings.Join(diff, "\n")
}

// treeOf maps each path under root to its type, mode and content (hashed
// into the string for files, the target for symlinks).
func treeOf(root string) map[string]string {
	out := map[string]string{}
	_ = filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			out[rel] = "symlink -> " + target
		case fi.IsDir():
			out[rel] = "dir"
		default:
			data, _ := os.ReadFile(p)
			out[rel] = fmt.Sprintf("file %v %d bytes %x", fi.Mode().Perm(), len(data), sum(data))
		}
		return nil
	})
	return out
}

func sum(b []byte) uint64 {
	var h uint64 = 14695981039346656037
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

// snapshot records every entry under dir: type, size, mode and mtime.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	_ = filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return nil
		}
		out[p] = fmt.Sprintf("%v %d %d", fi.Mode(), fi.Size(), fi.ModTime().UnixNano())
		return nil
	})
	return out
}

func compareSnapshots(before, after map[string]string) string {
	var diff []string
	for p, a := range after {
		if b, ok := before[p]; !ok {
			diff = append(diff, "new: "+p)
		} else if a != b {
			diff = append(diff, "changed: "+p)
		}
	}
	for p := range before {
		if _, ok := after[p]; !ok {
			diff = append(diff, "removed: "+p)
		}
	}
	return strings.Join(diff, "\n")
}
