package audit

import (
	"bytes"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fill appends n entries whose details carry a marker naming their seq
// (the chain is empty before: entry i is marker i).
func fill(t *testing.T, db *DB, n int, at func(i int) time.Time) {
	t.Helper()
	var evs []Event
	for i := 1; i <= n; i++ {
		ev := Event{Kind: KindProcessStart, KeyID: "k1", SandboxID: "sb1", Route: "POST /process.Process/Start", Status: 200,
			Client: "127.0.0.1", Detail: map[string]any{"argv": []string{"echo", fmt.Sprintf("marker-%05d", i)}}}
		if at != nil {
			ev.Time = at(i)
		}
		evs = append(evs, ev)
	}
	if err := db.Append(evs...); err != nil {
		t.Fatal(err)
	}
}

func openDB(t *testing.T, dir string) *DB {
	t.Helper()
	db, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// raw opens the database file as an attacker would, past the package.
func raw(t *testing.T, db *DB) *sql.DB {
	t.Helper()
	r, err := sql.Open("sqlite", "file:"+db.Path()+"?_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func exec(t *testing.T, db *sql.DB, q string, args ...any) {
	t.Helper()
	if _, err := db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// wantBreak verifies and wants the first break at seq, its reason
// containing what.
func wantBreak(t *testing.T, db *DB, seq int64, what string, checks ...Checkpoint) *Report {
	t.Helper()
	rep, err := db.Verify(checks...)
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() {
		t.Fatalf("verify passed (%d entries, %d..%d); want a break at entry %d", rep.Entries, rep.First, rep.Last, seq)
	}
	if b := rep.Breaks[0]; b.Seq != seq || !strings.Contains(b.Reason, what) {
		t.Fatalf("first break %v; want entry %d: ...%s...", rep.Breaks, seq, what)
	}
	t.Logf("verify: %s", rep.Breaks[0])
	return rep
}

func wantOK(t *testing.T, db *DB, checks ...Checkpoint) *Report {
	t.Helper()
	rep, err := db.Verify(checks...)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("verify: %v", rep.Breaks)
	}
	return rep
}

func TestChainVerifies(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 200, nil)
	rep := wantOK(t, db)
	seq, h, err := db.Head()
	if err != nil {
		t.Fatal(err)
	}
	if rep.Entries != 200 || rep.First != 1 || rep.Last != 200 || seq != 200 || h != rep.Head {
		t.Fatalf("report %+v, head %d %s", rep, seq, h)
	}
	es, err := db.Query(Filter{All: true, After: 199})
	if err != nil || len(es) != 1 || es[0].Prev == Genesis || es[0].Hash != h || es[0].ComputeHash() != h {
		t.Fatalf("last entry %+v, %v", es, err)
	}
}

// A byte of the database file changed, where the entry's text lies: the
// chain breaks at that entry.
func TestVerifyByteChangedInFile(t *testing.T) {
	dir := t.TempDir()
	db, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	fill(t, db, 300, nil)
	path := db.Path()
	db.Close() // checkpoints the log into the file
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(b, []byte("marker-00123"))
	if i < 0 || bytes.Count(b, []byte("marker-00123")) != 1 {
		t.Fatalf("marker found %d times in the file", bytes.Count(b, []byte("marker-00123")))
	}
	b[i+len("marker-0012")] = '9' // marker-00129, the same length
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	db = openDB(t, dir)
	wantBreak(t, db, 123, "changed")
}

func TestVerifyEntryDeleted(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 100, nil)
	exec(t, raw(t, db), "DELETE FROM entries WHERE seq = 57")
	wantBreak(t, db, 57, "missing")
}

func TestVerifyEntriesSwapped(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 100, nil)
	r := raw(t, db)
	// Every column but the number: the rows trade places.
	cols := "time, kind, source, key_id, team_id, sandbox_id, route, status, client, detail, prev, hash"
	exec(t, r, "CREATE TEMP TABLE t AS SELECT seq, "+cols+" FROM entries WHERE seq IN (30, 61)")
	set := []string{}
	for _, c := range strings.Split(cols, ", ") {
		set = append(set, fmt.Sprintf("%s = (SELECT %s FROM t WHERE t.seq = 91 - entries.seq)", c, c))
	}
	exec(t, r, "UPDATE entries SET "+strings.Join(set, ", ")+" WHERE seq IN (30, 61)")
	rep := wantBreak(t, db, 30, "")
	if len(rep.Breaks) < 2 {
		t.Fatalf("breaks %v: want both places", rep.Breaks)
	}
}

// An entry rewritten with its hash recomputed: the next entry's link
// breaks.
func TestVerifyEntryRewrittenWithItsHash(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 50, nil)
	es, err := db.Query(Filter{All: true, After: 39, Limit: 1})
	if err != nil || len(es) != 1 {
		t.Fatal(err)
	}
	e := es[0]
	e.Detail = `{"argv":["true"]}`
	e.Hash = e.ComputeHash()
	exec(t, raw(t, db), "UPDATE entries SET detail = ?, hash = ? WHERE seq = 40", e.Detail, e.Hash)
	wantBreak(t, db, 41, "does not follow entry 40")
}

func TestRetainByAgeKeepsChainVerifiable(t *testing.T) {
	db := openDB(t, t.TempDir())
	now := time.Now()
	db.now = func() time.Time { return now }
	// 12,000 entries a day old, then 100 new.
	fill(t, db, 12000, func(int) time.Time { return now.Add(-24 * time.Hour) })
	var evs []Event
	for i := 0; i < 100; i++ {
		evs = append(evs, Event{Kind: KindAPICall, Time: now})
	}
	if err := db.Append(evs...); err != nil {
		t.Fatal(err)
	}
	n, err := db.Retain(time.Hour, 0)
	if err != nil || n != 12000 {
		t.Fatalf("retain removed %d, %v; want 12000", n, err)
	}
	rep := wantOK(t, db)
	if rep.First != 12001 || rep.Pruned != 12000 {
		t.Fatalf("after retention: %+v", rep)
	}
	anchors, _ := db.Query(Filter{All: true, Kinds: []string{KindAnchor}})
	if len(anchors) != 3 { // chunks of 5000
		t.Fatalf("%d anchors; want 3", len(anchors))
	}
	// Entries removed from the front without an anchor: a break.
	exec(t, raw(t, db), "DELETE FROM entries WHERE seq <= 12005")
	wantBreak(t, db, 12006, "no anchor")
}

func TestRetainBySize(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 20000, nil)
	size, _ := db.Size()
	n, err := db.Retain(0, size/3)
	if err != nil || n == 0 {
		t.Fatalf("retain removed %d, %v", n, err)
	}
	after, _ := db.Size()
	if after > size/3 {
		t.Fatalf("size %d after retention; want at most %d", after, size/3)
	}
	rep := wantOK(t, db)
	t.Logf("%d bytes -> %d: removed %d entries, %d left (%d..%d)", size, after, n, rep.Entries, rep.First, rep.Last)
}

// A head exported earlier catches what the chain alone cannot: entries
// removed from its end, and the whole chain rewritten.
func TestCheckpoint(t *testing.T) {
	db := openDB(t, t.TempDir())
	fill(t, db, 100, nil)
	seq, h, _ := db.Head()
	cp := Checkpoint{Seq: seq, Hash: h}
	if _, err := ParseCheckpoint(cp.String()); err != nil {
		t.Fatal(err)
	}
	wantOK(t, db, cp)
	r := raw(t, db)
	exec(t, r, "DELETE FROM entries WHERE seq > 90")
	if rep := wantOK(t, db); rep.Last != 90 {
		t.Fatalf("%+v", rep)
	}
	wantBreak(t, db, 91, "past the chain's end", cp)

	// Rewritten whole: a fresh chain of the same length verifies alone.
	db2 := openDB(t, t.TempDir())
	fill(t, db2, 100, nil)
	exec(t, r, "DELETE FROM entries")
	exec(t, r, "ATTACH DATABASE ? AS other", db2.Path())
	exec(t, r, "INSERT INTO entries SELECT * FROM other.entries")
	wantOK(t, db)
	// (db2's chain is the same events at other times: other hashes.)
	wantBreak(t, db, 100, "rewritten", cp)
}

func TestParseCheckpointRefuses(t *testing.T) {
	for _, s := range []string{"", "12", "x:" + Genesis, "0:" + Genesis, "5:abc", "5:" + strings.ToUpper(strings.Repeat("a", 64))} {
		if _, err := ParseCheckpoint(s); err == nil {
			t.Errorf("%q parsed", s)
		}
	}
}

func TestQueryFilters(t *testing.T) {
	db := openDB(t, t.TempDir())
	t0 := time.Now().Add(-time.Hour)
	evs := []Event{
		{Kind: KindCreate, KeyID: "a", SandboxID: "s1", Time: t0},
		{Kind: KindProcessStart, KeyID: "a", SandboxID: "s1", Time: t0.Add(time.Minute)},
		{Kind: KindProcessEnd, KeyID: "a", SandboxID: "s1", Time: t0.Add(2 * time.Minute)},
		{Kind: KindProcessStart, KeyID: "b", SandboxID: "s2", Time: t0.Add(3 * time.Minute)},
		{Kind: KindAPICall, KeyID: "b", Time: t0.Add(4 * time.Minute)},
		{Kind: "processx.y", KeyID: "a", Time: t0.Add(5 * time.Minute)},
	}
	if err := db.Append(evs...); err != nil {
		t.Fatal(err)
	}
	count := func(f Filter) int {
		es, err := db.Query(f)
		if err != nil {
			t.Fatal(err)
		}
		return len(es)
	}
	for _, x := range []struct {
		name string
		f    Filter
		want int
	}{
		{"all", Filter{All: true}, 6},
		{"key a", Filter{KeyID: "a"}, 4},
		{"key b", Filter{KeyID: "b"}, 2},
		{"no key sees nothing", Filter{}, 0},
		{"family", Filter{All: true, Kinds: []string{"process"}}, 3},
		{"kind", Filter{All: true, Kinds: []string{KindProcessEnd, KindAPICall}}, 2},
		{"sandbox of a", Filter{KeyID: "a", SandboxID: "s1"}, 3},
		{"sandbox of b seen by a", Filter{KeyID: "a", SandboxID: "s2"}, 0},
		{"since", Filter{All: true, Since: t0.Add(150 * time.Second)}, 3},
		{"until", Filter{All: true, Until: t0.Add(90 * time.Second)}, 2},
		{"after", Filter{All: true, After: 4}, 2},
		{"limit", Filter{All: true, Limit: 2}, 2},
	} {
		if got := count(x.f); got != x.want {
			t.Errorf("%s: %d entries; want %d", x.name, got, x.want)
		}
	}
	if _, err := db.Query(Filter{All: true, Kinds: []string{"x' OR 1=1 --"}}); err == nil {
		t.Error("a kind that is not one was accepted")
	}
}

func TestOpenRefusesNewerSchema(t *testing.T) {
	dir := t.TempDir()
	db := openDB(t, dir)
	exec(t, raw(t, db), "PRAGMA user_version = 99")
	db.Close()
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("open: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dir, FileName)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%v %v", fi.Mode(), err)
	}
}
