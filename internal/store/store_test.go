package store

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"
)

func openTest(t *testing.T, dir string) *Store {
	t.Helper()
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("Open(%s): %v", dir, err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// ts makes a time the way the store returns it (UTC, no monotonic reading),
// so reflect.DeepEqual can compare whole sandboxes.
func ts(sec int64) time.Time { return time.Unix(sec, 123456789).UTC() }

func sample(id string) *Sandbox {
	return &Sandbox{
		ID:            id,
		KeyID:         "key_000000000001",
		TemplateID:    "base",
		Wall:          "process",
		State:         StateRunning,
		Metadata:      map[string]string{"user": "alice", "q": "a=b&c=d"},
		EnvVars:       map[string]string{"FOO": "bar"},
		CPUs:          1.5,
		Memory:        512 << 20,
		Disk:          2048 << 20,
		Pids:          256,
		AccessToken:   "at-" + id,
		TrafficToken:  "tt-" + id,
		AgentPID:      4242,
		AgentStart:    math.MaxUint64 - 7, // above MaxInt64: must survive the signed column
		StartedAt:     ts(1_700_000_000),
		EndAt:         ts(1_700_000_300),
		AllowInternet: true,
		AutoPause:     false,
	}
}

func TestOpenModesAndPragmas(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data", "nested")
	s := openTest(t, dir)
	if err := s.InsertSandbox(sample("a1")); err != nil { // makes the WAL exist
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		dir:                                 0o700,
		filepath.Join(dir, FileName):        0o600,
		filepath.Join(dir, FileName+"-wal"): 0o600,
	} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s: mode %o, want %o", path, got, want)
		}
	}
	for pragma, want := range map[string]string{
		"journal_mode": "wal",
		"synchronous":  "1", // NORMAL
		"foreign_keys": "1",
		"busy_timeout": "5000",
		"user_version": fmt.Sprint(SchemaVersion),
	} {
		var got string
		if err := s.db.QueryRow("PRAGMA " + pragma).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("PRAGMA %s = %q, want %q", pragma, got, want)
		}
	}
	if s.Path() != filepath.Join(dir, FileName) {
		t.Errorf("Path() = %q", s.Path())
	}
}

func TestOpenOddDirectoryName(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "we?ird #dir%20&x=y")
	s := openTest(t, dir)
	if err := s.InsertSandbox(sample("a1")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, FileName)); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(filepath.Dir(dir))
	if len(entries) != 1 {
		t.Errorf("expected only the data dir next to it, got %v", entries)
	}
}

func TestPersistenceAndIdempotentMigrations(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := sample("persist1")
	if err := s.InsertSandbox(want); err != nil {
		t.Fatal(err)
	}
	plain, _, err := s.CreateKey("ci")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.AddEvent("persist1", "created", "x"); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	schema := func(s *Store) string {
		rows, err := s.db.Query("SELECT type || ' ' || name FROM sqlite_master ORDER BY name")
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var all string
		for rows.Next() {
			var n string
			rows.Scan(&n)
			all += n + "\n"
		}
		return all
	}
	var first string
	for i := 0; i < 3; i++ {
		s, err := Open(dir)
		if err != nil {
			t.Fatalf("reopen %d: %v", i, err)
		}
		got, err := s.GetSandbox("persist1")
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("reopen %d:\n got %+v\nwant %+v", i, got, want)
		}
		if _, err := s.VerifyKey(plain); err != nil {
			t.Errorf("reopen %d: key: %v", i, err)
		}
		if evs, err := s.Events("persist1", 0); err != nil || len(evs) != 1 {
			t.Errorf("reopen %d: events %v %v", i, evs, err)
		}
		sc := schema(s)
		if i == 0 {
			first = sc
		} else if sc != first {
			t.Errorf("schema changed on reopen:\n%s\nvs\n%s", sc, first)
		}
		s.Close()
	}
}

func TestNewerSchemaRefused(t *testing.T) {
	dir := t.TempDir()
	s := openTest(t, dir)
	if _, err := s.db.Exec(fmt.Sprintf("PRAGMA user_version = %d", SchemaVersion+1)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if s2, err := Open(dir); err == nil {
		s2.Close()
		t.Fatal("opened a database from the future")
	}
}

func TestSandboxCRUD(t *testing.T) {
	s := openTest(t, t.TempDir())
	sb := sample("abc123")
	if err := s.InsertSandbox(sb); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetSandbox("abc123")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, sb) {
		t.Fatalf("got %+v\nwant %+v", got, sb)
	}
	dup := sample("abc123")
	dup.TemplateID = "other"
	if err := s.InsertSandbox(dup); !errors.Is(err, ErrConflict) {
		t.Fatalf("duplicate insert: %v, want ErrConflict", err)
	}
	if got, _ := s.GetSandbox("abc123"); got.TemplateID != "base" {
		t.Fatal("duplicate insert overwrote the row")
	}
	for _, bad := range []string{"", "ABC", "a-b", "a b", "é"} {
		if err := s.InsertSandbox(sample(bad)); err == nil {
			t.Errorf("insert id %q: no error", bad)
		}
	}
	if err := s.InsertSandbox(nil); err == nil {
		t.Error("insert nil: no error")
	}

	sb.State = StatePaused
	sb.Metadata = nil
	sb.EnvVars = map[string]string{"A": "1", "B": "2"}
	sb.AgentPID, sb.AgentStart = 0, 0
	sb.EndAt = time.Time{}
	sb.AllowInternet, sb.AutoPause = false, true
	if err := s.UpdateSandbox(sb); err != nil {
		t.Fatal(err)
	}
	got, _ = s.GetSandbox("abc123")
	sb.Metadata = map[string]string{} // nil comes back empty, never nil
	if !reflect.DeepEqual(got, sb) {
		t.Fatalf("after update got %+v\nwant %+v", got, sb)
	}
	if err := s.UpdateSandbox(sample("nope")); !errors.Is(err, ErrNotFound) {
		t.Errorf("update missing: %v", err)
	}

	if err := s.SetState("abc123", StateKilled); err != nil {
		t.Fatal(err)
	}
	end := ts(1_800_000_000)
	if err := s.SetEndAt("abc123", end); err != nil {
		t.Fatal(err)
	}
	got, _ = s.GetSandbox("abc123")
	if got.State != StateKilled || !got.EndAt.Equal(end) {
		t.Errorf("state %q end %v", got.State, got.EndAt)
	}
	if err := s.SetState("nope", StateKilled); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetState missing: %v", err)
	}
	if err := s.SetEndAt("nope", end); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetEndAt missing: %v", err)
	}

	if err := s.DeleteSandbox("abc123"); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteSandbox("abc123"); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	if _, err := s.GetSandbox("abc123"); !errors.Is(err, ErrNotFound) {
		t.Errorf("get deleted: %v", err)
	}
	all, err := s.AllSandboxes()
	if err != nil || len(all) != 0 {
		t.Errorf("AllSandboxes = %v, %v", all, err)
	}
}

func TestEvents(t *testing.T) {
	s := openTest(t, t.TempDir())
	clock := ts(1_700_000_000)
	s.now = func() time.Time { return clock }
	for i := 0; i < 5; i++ {
		if err := s.AddEvent("sb1", fmt.Sprint("k", i), fmt.Sprint("d", i)); err != nil {
			t.Fatal(err)
		}
		if i == 2 {
			clock = clock.Add(-time.Hour) // the clock steps back; order must not
		} else {
			clock = clock.Add(time.Second)
		}
	}
	if err := s.AddEvent("sb2", "other", ""); err != nil {
		t.Fatal(err)
	}
	if err := s.AddEvent("sb1", "", ""); err == nil {
		t.Error("empty kind accepted")
	}
	evs, err := s.Events("sb1", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 5 {
		t.Fatalf("got %d events", len(evs))
	}
	for i, e := range evs {
		if want := fmt.Sprint("k", 4-i); e.Kind != want || e.SandboxID != "sb1" {
			t.Errorf("event %d = %+v, want kind %s", i, e, want)
		}
		if i > 0 && e.ID >= evs[i-1].ID {
			t.Errorf("ids not decreasing: %d then %d", evs[i-1].ID, e.ID)
		}
	}
	if !evs[4].Time.Equal(ts(1_700_000_000)) {
		t.Errorf("first event time %v", evs[4].Time)
	}
	if evs, _ := s.Events("sb1", 2); len(evs) != 2 || evs[0].Kind != "k4" || evs[1].Kind != "k3" {
		t.Errorf("limit 2: %+v", evs)
	}
	if evs, _ := s.Events("", 0); len(evs) != 6 || evs[0].Kind != "other" {
		t.Errorf("all events: %+v", evs)
	}
	if evs, _ := s.Events("none", 0); len(evs) != 0 {
		t.Errorf("unknown sandbox: %+v", evs)
	}
	// Events outlive their sandbox; pruning bounds them.
	n, err := s.PruneEvents(ts(1_700_000_000).Add(time.Nanosecond))
	if err != nil || n != 4 { // k0 at t0; k3, k4 and other stepped back an hour
		t.Errorf("PruneEvents = %d, %v", n, err)
	}
}

func TestConcurrentUse(t *testing.T) {
	s := openTest(t, t.TempDir())
	plain, _, err := s.CreateKey("shared")
	if err != nil {
		t.Fatal(err)
	}
	const workers, rounds = 8, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				sb := sample(fmt.Sprintf("w%dr%d", w, r))
				sb.StartedAt = ts(int64(r)) // many share a StartedAt
				sb.Metadata = map[string]string{"worker": fmt.Sprint(w)}
				if err := s.InsertSandbox(sb); err != nil {
					errs <- err
					return
				}
				if _, _, err := s.ListSandboxes(ListFilter{Metadata: map[string]string{"worker": fmt.Sprint(w)}, Limit: 5}); err != nil {
					errs <- err
					return
				}
				if _, err := s.VerifyKey(plain); err != nil {
					errs <- err
					return
				}
				if err := s.AddEvent(sb.ID, "created", ""); err != nil {
					errs <- err
					return
				}
				if err := s.SetState(sb.ID, StatePaused); err != nil {
					errs <- err
					return
				}
				if r%5 == 0 {
					if _, _, err := s.CreateKey(fmt.Sprint("k", w, r)); err != nil {
						errs <- err
						return
					}
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	all, err := s.AllSandboxes()
	if err != nil || len(all) != workers*rounds {
		t.Fatalf("AllSandboxes: %d, %v", len(all), err)
	}
	// Walking the pages of a table full of StartedAt ties sees each row once.
	seen := walk(t, s, ListFilter{States: []string{StatePaused}, Limit: 7})
	if len(seen) != workers*rounds {
		t.Errorf("walked %d of %d", len(seen), workers*rounds)
	}
	if evs, _ := s.Events("", 0); len(evs) != workers*rounds {
		t.Errorf("%d events", len(evs))
	}
}

// TestCrashSimulation copies the database and its WAL while the store is open
// (as a crash would leave them, never checkpointed) and opens the copy.
func TestCrashSimulation(t *testing.T) {
	dir := t.TempDir()
	s := openTest(t, dir)
	for i := 0; i < 20; i++ {
		if err := s.InsertSandbox(sample(fmt.Sprint("crash", i))); err != nil {
			t.Fatal(err)
		}
	}
	plain, _, err := s.CreateKey("crash")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetState("crash3", StateKilled); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, FileName+"-wal")); err != nil || fi.Size() == 0 {
		t.Fatalf("expected a non-empty WAL: %v", err)
	}

	// A second Store on the same files while the first is still open (a
	// restarted daemon whose predecessor has not let go yet).
	s2 := openTest(t, dir)
	if got, err := s2.GetSandbox("crash3"); err != nil || got.State != StateKilled {
		t.Fatalf("second store: %v %v", got, err)
	}

	// The main file alone does not have the rows yet (no checkpoint so far),
	// so what follows really exercises recovery from the WAL.
	mainOnly := t.TempDir()
	copyFile(t, filepath.Join(dir, FileName), filepath.Join(mainOnly, FileName))
	if all, err := openTest(t, mainOnly).AllSandboxes(); err != nil || len(all) == 20 {
		t.Fatalf("main file alone: %d sandboxes, %v; the test proves nothing", len(all), err)
	}

	crashDir := t.TempDir()
	for _, name := range []string{FileName, FileName + "-wal"} {
		copyFile(t, filepath.Join(dir, name), filepath.Join(crashDir, name))
	}
	c := openTest(t, crashDir)
	all, err := c.AllSandboxes()
	if err != nil || len(all) != 20 {
		t.Fatalf("after crash: %d sandboxes, %v", len(all), err)
	}
	if got, _ := c.GetSandbox("crash3"); got.State != StateKilled {
		t.Errorf("crash3 state %q", got.State)
	}
	if _, err := c.VerifyKey(plain); err != nil {
		t.Errorf("key lost in crash: %v", err)
	}
	if err := c.InsertSandbox(sample("aftercrash")); err != nil {
		t.Errorf("write after recovery: %v", err)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
