package daemontest

import (
	"bytes"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "modernc.org/sqlite"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/testutil"
)

// auditConfig writes a config with the world's resolver and an audit
// section; it returns its path (rewrite it and restart to change it).
func auditConfig(t *testing.T, section map[string]any) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cage.json")
	writeAuditConfig(t, p, section)
	return p
}

func writeAuditConfig(t *testing.T, p string, section map[string]any) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"network": map[string]any{"dns": testutil.SharedWorld(t).Upstreams()}, "audit": section})
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// auditOf pages through GET /audit with key and q.
func (d *daemon) auditOf(t *testing.T, key string, q url.Values) ([]types.AuditEntry, int64) {
	t.Helper()
	if q == nil {
		q = url.Values{}
	}
	q.Set("limit", "500")
	var all []types.AuditEntry
	var dropped int64
	for pages := 0; ; pages++ {
		if pages > 200 {
			t.Fatal("more than 200 pages of audit entries")
		}
		r := d.expect(t, http.StatusOK, call{method: "GET", path: "/audit?" + q.Encode(), key: key})
		var page types.AuditPage
		r.decode(t, &page)
		if h := r.header.Get("X-Next-Token"); h != page.NextToken {
			t.Errorf("X-Next-Token %q, body's nextToken %q", h, page.NextToken)
		}
		all, dropped = append(all, page.Entries...), page.Dropped
		if page.NextToken == "" {
			return all, dropped
		}
		q.Set("nextToken", page.NextToken)
	}
}

// find returns the entries of a kind that match.
func find(es []types.AuditEntry, kind string, match func(types.AuditEntry) bool) []types.AuditEntry {
	var out []types.AuditEntry
	for _, e := range es {
		if e.Kind == kind && (match == nil || match(e)) {
			out = append(out, e)
		}
	}
	return out
}

func sha256hex(s string) string { h := sha256.Sum256([]byte(s)); return hex.EncodeToString(h[:]) }

func detailHas(e types.AuditEntry, s string) bool {
	b, _ := json.Marshal(e.Detail)
	return strings.Contains(string(b), s)
}

// waitAudit polls the key's trail until an entry of kind matches (the
// sampler reads cgroup counters every 5 s; a timeout fires on its own).
func (d *daemon) waitAudit(t *testing.T, key, kind string, match func(types.AuditEntry) bool) types.AuditEntry {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		es, _ := d.auditOf(t, key, url.Values{"kind": {kind}})
		if m := find(es, kind, match); len(m) > 0 {
			return m[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s entry in 30 s; the trail: %v", kind, es)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// cageOK runs the CLI and fails unless it exits 0; it returns stdout.
func (d *daemon) cageOK(t *testing.T, key string, args ...string) string {
	t.Helper()
	r := d.cli(t, key, args...)
	if r.code != 0 {
		t.Fatalf("cage %s: %v", strings.Join(args, " "), r)
	}
	return r.stdout
}

// A session driven by the CLI; every kind it makes must be in the key's
// trail with what was done, and nothing of another key's; the chain
// verifies, then fails at the right entry after a byte of the store is
// changed, an entry deleted or two swapped; retention removes the old and
// the chain still verifies.
func TestAuditCLISession(t *testing.T) {
	cfg := auditConfig(t, nil)
	d := startDaemon(t, "--config", cfg)
	keyB := d.createKey(t, "tenant-b")
	d.createKey(t, "to-revoke")
	var keys []struct{ ID, Name string }
	if err := json.Unmarshal([]byte(d.cageOK(t, "", "keys", "ls", "--data", d.data, "--json")), &keys); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if k.Name == "to-revoke" {
			d.cageOK(t, "", "keys", "revoke", "--data", d.data, k.ID)
		}
	}
	sb := strings.TrimSpace(d.cageOK(t, d.key, "create", "--net", "internet", "--timeout", "2m"))
	d.remember(sb, d.key)
	if r := d.cli(t, d.key, "exec", sb, "--", "sh", "-c", "echo audit-marker-cli; exit 3"); r.code != 3 {
		t.Fatalf("exec: %v", r)
	}
	d.cli(t, d.key, "exec", sb, "--", "getent", "hosts", "allowed.example.com")
	local := filepath.Join(t.TempDir(), "in.txt")
	os.WriteFile(local, []byte("copied in\n"), 0o600)
	d.cageOK(t, d.key, "cp", local, sb+":/tmp/cli.txt")
	d.cageOK(t, d.key, "cp", sb+":/tmp/cli.txt", filepath.Join(t.TempDir(), "out.txt"))
	d.cageOK(t, d.key, "pause", sb)
	d.cageOK(t, d.key, "resume", sb)
	d.cageOK(t, d.key, "snapshot", sb)
	for _, id := range strings.Fields(d.cageOK(t, d.key, "fork", sb)) {
		d.remember(id, d.key)
		d.cageOK(t, d.key, "rm", id)
	}
	// Limits hit, as the host's cgroup counters say.
	small := strings.TrimSpace(d.cageOK(t, d.key, "create", "--memory", "64M", "--pids", "16", "--timeout", "2m"))
	d.remember(small, d.key)
	d.cli(t, d.key, "exec", small, "--", "python3", "-c", "b = bytearray(256 << 20)")
	d.cli(t, d.key, "exec", small, "--", "sh", "-c", "for i in $(seq 40); do sleep 3 & done; wait")
	short := strings.TrimSpace(d.cageOK(t, d.key, "create", "--timeout", "1s"))
	// Another tenant, anonymous callers, a request without the token.
	d.expect(t, http.StatusNotFound, call{method: "GET", path: "/sandboxes/" + sb, key: keyB})
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/v2/sandboxes"})
	if r := d.proxyGet(t, "/files?path=/etc/hostname", map[string]string{"E2b-Sandbox-Id": sb}, ""); r.status != http.StatusUnauthorized {
		t.Fatalf("proxy without a token: %v", r)
	}
	oom := d.waitAudit(t, d.key, "sandbox.oom", nil)
	d.waitAudit(t, d.key, "sandbox.pids_limit", nil)
	d.waitAudit(t, d.key, "sandbox.timeout", func(e types.AuditEntry) bool { return e.SandboxID == short })
	d.cageOK(t, d.key, "rm", sb, small)

	mine := d.checkSessionTrail(t, sb, small, oom)
	d.checkOthersTrails(t, keyB, sb)
	d.checkAuditBadInput(t)
	marker := find(mine, "process.start", func(e types.AuditEntry) bool { return detailHas(e, "audit-marker-cli") })[0]

	if out := d.cageOK(t, "", "audit", "verify", "--data", d.data); !strings.Contains(out, "OK: the chain holds") {
		t.Fatalf("verify: %s", out)
	}
	d.stop(t)
	d.checkTampering(t, marker.Seq)

	// Retention: restarted with a trail kept one second, the old entries
	// go and an anchor stands for them; the chain still verifies.
	writeAuditConfig(t, cfg, map[string]any{"max_age": "1s"})
	time.Sleep(1100 * time.Millisecond)
	d.start(t)
	d.cageOK(t, d.key, "ls")
	out := d.cageOK(t, "", "audit", "verify", "--data", d.data)
	if !strings.Contains(out, "removed by retention, anchored") || !strings.Contains(out, "OK: the chain holds") {
		t.Fatalf("verify after retention: %s", out)
	}
	if es, _ := d.auditOf(t, d.key, url.Values{"kind": {"process"}}); len(es) != 0 {
		t.Fatalf("entries older than max_age kept: %v", es)
	}
}

// checkSessionTrail checks the CLI session's entries in key A's trail and
// returns them.
func (d *daemon) checkSessionTrail(t *testing.T, sb, small string, oom types.AuditEntry) []types.AuditEntry {
	t.Helper()
	es, _ := d.auditOf(t, d.key, nil)
	keyA := ""
	if c := find(es, "sandbox.create", func(e types.AuditEntry) bool { return e.SandboxID == sb }); len(c) == 1 {
		keyA = c[0].KeyID
	}
	for _, e := range es {
		if e.KeyID != keyA || keyA == "" {
			t.Errorf("entry %d (%s) of key %q in key A's (%q) trail", e.Seq, e.Kind, e.KeyID, keyA)
		}
	}
	want := map[string]func(types.AuditEntry) bool{
		"key.create": nil, "sandbox.create": nil, "sandbox.pause": nil, "sandbox.resume": nil,
		"sandbox.snapshot": nil, "sandbox.fork": nil, "sandbox.kill": nil,
		"api.call": func(e types.AuditEntry) bool {
			return e.Route == "POST /sandboxes/{sandboxID}/pause" && e.SandboxID == sb && e.Status == 204 && e.Client == "127.0.0.1"
		},
		"process.start": func(e types.AuditEntry) bool {
			return e.Source == "host" && detailHas(e, `"argv":["sh","-c","echo audit-marker-cli; exit 3"]`)
		},
		"process.end": func(e types.AuditEntry) bool {
			return e.Source == "agent" && e.Detail["exit_code"] == float64(3)
		},
		"file.write": func(e types.AuditEntry) bool {
			return e.Detail["path"] == "/tmp/cli.txt" && e.Detail["size"] == float64(10) && e.Detail["sha256"] == sha256hex("copied in\n")
		},
		"file.read": func(e types.AuditEntry) bool { return e.Detail["path"] == "/tmp/cli.txt" },
		"net.dns":   func(e types.AuditEntry) bool { return e.Detail["name"] == "allowed.example.com" },
	}
	for kind, match := range want {
		if len(find(es, kind, match)) == 0 {
			t.Errorf("no matching %s entry in key A's trail", kind)
		}
	}
	if oom.SandboxID != small || oom.Source != "host" {
		t.Errorf("oom entry %+v", oom)
	}
	return es
}

// checkOthersTrails: B sees its own 404 on A's sandbox and nothing of A's;
// A never sees it; the operator sees the anonymous and refused requests.
func (d *daemon) checkOthersTrails(t *testing.T, keyB, sb string) {
	t.Helper()
	bs, _ := d.auditOf(t, keyB, nil)
	if len(bs) == 0 {
		t.Fatal("tenant B's trail is empty: its key's creation and its call are missing")
	}
	for _, e := range bs {
		if e.SandboxID == sb && !(e.Kind == "api.call" && e.Status == 404) {
			t.Errorf("tenant B sees entry %d (%s) of A's sandbox", e.Seq, e.Kind)
		}
	}
	onA, dropped := d.auditOf(t, keyB, url.Values{"sandboxID": {sb}})
	if len(onA) != 1 || onA[0].Status != 404 || dropped != 0 {
		t.Errorf("tenant B's entries on A's sandbox: %v (dropped %d); want its own 404 alone", onA, dropped)
	}
	as, _ := d.auditOf(t, d.key, url.Values{"sandboxID": {sb}, "kind": {"api"}})
	if len(find(as, "api.call", func(e types.AuditEntry) bool { return e.Status == 404 })) != 0 {
		t.Error("tenant A sees tenant B's call on its sandbox")
	}
	var ops []types.AuditEntry
	for _, line := range strings.Split(strings.TrimSpace(d.cageOK(t, "", "audit", "--data", d.data, "--kind", "proxy,api", "--json")), "\n") {
		var e types.AuditEntry
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("a JSON line %q: %v", line, err)
		}
		ops = append(ops, e)
	}
	if len(find(ops, "proxy.denied", func(e types.AuditEntry) bool { return e.SandboxID == sb && e.KeyID == "" })) == 0 ||
		len(find(ops, "api.call", func(e types.AuditEntry) bool { return e.Status == 401 && e.KeyID == "" })) == 0 {
		t.Error("the operator's trail lacks the refused proxy request or the anonymous call")
	}
}

func (d *daemon) checkAuditBadInput(t *testing.T) {
	t.Helper()
	for _, q := range []string{"limit=0", "limit=1001", "kind=process.start.x", "kind=" + url.QueryEscape("x' OR 1=1"), "nextToken=abc", "since=yesterday"} {
		d.expect(t, http.StatusBadRequest, call{method: "GET", path: "/audit?" + q, key: d.key, invalid: true})
	}
	d.expect(t, http.StatusUnauthorized, call{method: "GET", path: "/audit"})
	if r := d.cli(t, d.key, "audit", "--kind", "bad kind"); r.code != 64 {
		t.Errorf("cage audit --kind 'bad kind': %v; want exit 64", r)
	}
	if r := d.cli(t, "", "audit", "verify", "--data", t.TempDir()); r.code != 66 {
		t.Errorf("cage audit verify of a directory without a trail: %v; want exit 66", r)
	}
}

// checkTampering changes copies of the stopped daemon's store three ways;
// verify must fail at the entry each change touched.
func (d *daemon) checkTampering(t *testing.T, seq int64) {
	t.Helper()
	copyStore := func() (string, string) {
		dir := t.TempDir()
		for _, f := range []string{"audit.db", "audit.db-wal"} {
			if b, err := os.ReadFile(filepath.Join(d.data, f)); err == nil {
				os.WriteFile(filepath.Join(dir, f), b, 0o600)
			}
		}
		return dir, filepath.Join(dir, "audit.db")
	}
	wantBroken := func(dir string, at int64, what string) {
		t.Helper()
		r := d.cli(t, "", "audit", "verify", "--data", dir)
		if r.code != 1 || !strings.Contains(r.stdout, fmt.Sprintf("BROKEN at entry %d: %s", at, what)) {
			t.Errorf("verify after %s: %v; want exit 1 and a break at entry %d", what, r, at)
		}
	}
	// A byte of the file.
	dir, path := copyStore()
	b, _ := os.ReadFile(path)
	if !bytes.Contains(b, []byte("audit-marker-cli")) {
		t.Fatal("the marker is not in the stopped daemon's audit.db (its log not checkpointed?)")
	}
	// Every copy (a page SQLite freed may hold an old one): one byte each.
	os.WriteFile(path, bytes.ReplaceAll(b, []byte("audit-marker-cli"), []byte("Audit-marker-cli")), 0o600)
	wantBroken(dir, seq, "changed")
	// An entry deleted, two swapped.
	dir, path = copyStore()
	exec := func(q string) {
		db, err := sql.Open("sqlite", path)
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec(fmt.Sprintf("DELETE FROM entries WHERE seq = %d", seq))
	wantBroken(dir, seq, "missing")
	dir, path = copyStore()
	exec(fmt.Sprintf(`UPDATE entries SET seq = CASE seq WHEN %d THEN -1 END WHERE seq = %d;
		UPDATE entries SET seq = %d WHERE seq = %d; UPDATE entries SET seq = %d WHERE seq = -1`, seq, seq, seq, seq+1, seq+1))
	wantBroken(dir, seq, "does not follow")
}

// A tenant runs 10,000 commands in a loop in one sandbox, through the
// proxy, four at a time. Expected: what the trail keeps of that sandbox
// stops at its cap (2,000 here) and the rest is counted (GET /audit's
// dropped, and the trail's audit.capped and audit.dropped entries); the
// trail's database stays small; another tenant's API calls are served
// meanwhile (p50/p95/p99 reported, quiet and during the loop, not
// asserted); the chain verifies.
func TestAuditCommandLoop(t *testing.T) {
	const perSandbox, commands, workers = 2000, 10000, 4
	d := startDaemon(t, "--config", auditConfig(t, map[string]any{"per_sandbox": perSandbox}))
	keyB := d.createKey(t, "bystander")
	looper := d.create(t, d.key, nil)
	bystander := d.create(t, keyB, nil)
	ac := d.agent(looper.SandboxID, looper.EnvdAccessToken)
	defer ac.Close()
	db, wal := filepath.Join(d.data, "audit.db"), filepath.Join(d.data, "audit.db-wal")
	sizeBefore, dbBefore := fileSize(db, wal), fileSize(db)
	quiet := d.latenciesAs(t, keyB, bystander.SandboxID, 300)

	start := time.Now()
	done := make(chan struct{})
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func() {
			for i := 0; i < commands/workers; i++ {
				if r := run(ac, "true"); r.err != nil || r.exit != 0 {
					errs <- fmt.Errorf("command %d: exit %d, %v", i, r.exit, r.err)
					return
				}
			}
			errs <- nil
		}()
	}
	go func() {
		for w := 0; w < workers; w++ {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
		close(done)
	}()
	var loud []time.Duration
	tick := time.NewTicker(10 * time.Millisecond) // a client at 100 calls a second
	defer tick.Stop()
	for loop := true; loop; {
		select {
		case <-done:
			loop = false
		case <-tick.C:
			t0 := time.Now()
			d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + bystander.SandboxID, key: keyB})
			loud = append(loud, time.Since(t0))
		}
	}
	elapsed := time.Since(start)
	during := stats.Summarize(loud)

	es, dropped := d.auditOf(t, d.key, url.Values{"sandboxID": {looper.SandboxID}, "kind": {"process,audit"}})
	procs := len(find(es, "process.start", nil)) + len(find(es, "process.end", nil))
	if procs != perSandbox || len(find(es, "audit.capped", nil)) != 1 {
		t.Errorf("the looper's trail keeps %d process entries and %d audit.capped; want %d and 1",
			procs, len(find(es, "audit.capped", nil)), perSandbox)
	}
	if want := int64(2*commands - perSandbox); dropped < want {
		t.Errorf("dropped %d; want at least %d (two entries a command beyond the cap)", dropped, want)
	}
	d.kill(t, d.key, looper.SandboxID)
	ended, _ := d.auditOf(t, d.key, url.Values{"sandboxID": {looper.SandboxID}, "kind": {"audit.dropped,sandbox.kill"}})
	if len(find(ended, "audit.dropped", nil)) == 0 || len(find(ended, "sandbox.kill", nil)) != 1 {
		t.Errorf("at its end: %v; want its kill and the count of what was not kept", ended)
	}
	// What the trail holds is the looper's kept entries, the bystander's
	// calls (one entry each: as many as the loop lasted, 100 a second) and
	// the set-up's few, never the dropped ones; and each is small. The
	// database file grows by its entries; its write-ahead log is a bounded
	// cost apart (a few MiB after a checkpoint, cut back to
	// journal_size_limit), which a short loop's few entries cannot carry.
	size := fileSize(db, wal)
	dbGrew, walSize := fileSize(db)-dbBefore, fileSize(wal)
	out := d.cageOK(t, "", "audit", "verify", "--data", d.data)
	if !strings.Contains(out, "OK: the chain holds") {
		t.Errorf("verify: %s", out)
	}
	var entries int64
	if m := regexp.MustCompile(`: (\d+) entries`).FindStringSubmatch(out); m != nil {
		entries, _ = strconv.ParseInt(m[1], 10, 64)
	}
	if most := int64(perSandbox + len(loud) + quiet.N + 100); entries == 0 || entries > most {
		t.Errorf("audit.db holds %d entries; want at most %d (%d kept of the looper's, %d calls of the bystander's, the set-up's)",
			entries, most, perSandbox, len(loud)+quiet.N)
	} else if dbGrew > entries*1024 {
		t.Errorf("audit.db grew %d bytes for %d entries (%d each, want at most 1 KiB)", dbGrew, entries, dbGrew/entries)
	}
	if walSize > auditWALLimit {
		t.Errorf("audit.db-wal is %d bytes, over the %d its journal_size_limit keeps it to", walSize, auditWALLimit)
	}
	t.Logf("%d commands in %v (%.0f/s, %d at a time); %d of their entries kept, %d counted; audit.db and its WAL %d -> %d bytes (the file +%d for %d entries, the WAL %d)",
		commands, elapsed.Round(time.Millisecond), float64(commands)/elapsed.Seconds(), workers, procs, dropped, sizeBefore, size, dbGrew, entries, walSize)
	t.Logf("another tenant's GET /sandboxes/{id}: quiet %s; during the loop %s", quiet, during)
}

// auditWALLimit is the audit database's journal_size_limit
// (internal/audit): what its write-ahead log is cut back to.
const auditWALLimit = 16 << 20

// latenciesAs times n GET /sandboxes/{id} with key.
func (d *daemon) latenciesAs(t *testing.T, key, id string, n int) stats.Stats {
	t.Helper()
	var samples []time.Duration
	for range n {
		start := time.Now()
		d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + id, key: key})
		samples = append(samples, time.Since(start))
	}
	return stats.Summarize(samples)
}
