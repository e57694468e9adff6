package store

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

func openRecords(t *testing.T, dir string) *Records {
	t.Helper()
	rs, err := OpenRecords(dir)
	if err != nil {
		t.Fatalf("OpenRecords(%s): %v", dir, err)
	}
	t.Cleanup(func() { rs.Close() })
	return rs
}

func rec(sb string, i int) NetRecord {
	return NetRecord{SandboxID: sb, Kind: "dns", Decision: "allow", Name: fmt.Sprintf("n%d.example.com", i), QType: "A"}
}

// Pages are newest first, each record once, one sandbox's only.
func TestRecordsPages(t *testing.T) {
	rs := openRecords(t, t.TempDir())
	var batch []NetRecord
	for i := range 250 {
		batch = append(batch, rec("a", i))
		if i%5 == 0 {
			batch = append(batch, rec("b", i))
		}
	}
	if err := rs.Add(batch, nil); err != nil {
		t.Fatal(err)
	}
	var got []string
	var before int64
	pages := 0
	for {
		page, err := rs.Page("a", before, 100)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, r := range page {
			if r.SandboxID != "a" {
				t.Fatalf("sandbox a's page holds a record of %q", r.SandboxID)
			}
			if before != 0 && r.ID >= before {
				t.Fatalf("record %d on the page after %d", r.ID, before)
			}
			got = append(got, r.Name)
		}
		if len(page) < 100 {
			break
		}
		before = page[len(page)-1].ID
	}
	if pages != 3 || len(got) != 250 || got[0] != "n249.example.com" || got[249] != "n0.example.com" {
		t.Errorf("%d pages, %d records, first %q, last %q; want 3, 250, n249 first and n0 last", pages, len(got), got[0], got[len(got)-1])
	}
	if kept, dropped, err := rs.Counts("a"); err != nil || kept != 250 || dropped != 0 {
		t.Errorf("counts of a: %d kept, %d dropped, %v", kept, dropped, err)
	}
	if err := rs.Add(nil, map[string]int64{"a": 7, "c": 3}); err != nil {
		t.Fatal(err)
	}
	if kept, dropped, _ := rs.Counts("a"); kept != 250 || dropped != 7 {
		t.Errorf("after drops, a: %d kept, %d dropped", kept, dropped)
	}
	if kept, dropped, _ := rs.Counts("c"); kept != 0 || dropped != 3 {
		t.Errorf("c: %d kept, %d dropped", kept, dropped)
	}
	if err := rs.Add([]NetRecord{{Kind: "dns"}}, nil); err == nil {
		t.Error("a record without a sandbox was written")
	}
}

// Retention: records past their age go; beyond the size the oldest go
// until the records fit, and the file gives the space back.
func TestRecordsRetention(t *testing.T) {
	rs := openRecords(t, t.TempDir())
	now := time.Unix(1_700_000_000, 0)
	rs.now = func() time.Time { return now }
	old := rec("a", 0)
	old.Time = now.Add(-48 * time.Hour)
	if err := rs.Add([]NetRecord{old, rec("a", 1)}, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := rs.Retain(24*time.Hour, 0); err != nil || n != 1 {
		t.Fatalf("Retain by age: %d, %v; want 1 deleted", n, err)
	}
	if page, _ := rs.Page("a", 0, 10); len(page) != 1 || page[0].Name != "n1.example.com" {
		t.Errorf("after retention by age: %+v", page)
	}
	detail := strings.Repeat("x", 1000)
	for b := range 20 {
		var batch []NetRecord
		for i := range 1000 {
			r := rec("a", b*1000+i)
			r.Detail = detail
			batch = append(batch, r)
		}
		if err := rs.Add(batch, nil); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := rs.Size()
	fileBefore := rs.FileSize()
	const max = 4 << 20
	if _, err := rs.Retain(0, max); err != nil {
		t.Fatal(err)
	}
	after, _ := rs.Size()
	if after > max {
		t.Errorf("records take %d bytes after retention to %d", after, max)
	}
	page, _ := rs.Page("a", 0, 1)
	if len(page) != 1 || page[0].Name != "n19999.example.com" {
		t.Errorf("the newest record did not survive retention: %+v", page)
	}
	if fileAfter := rs.FileSize(); fileAfter >= fileBefore {
		t.Errorf("the files did not shrink: %d bytes before, %d after", fileBefore, fileAfter)
	}
	t.Logf("records: %d bytes before, %d after retention to %d; files %d -> %d bytes", before, after, max, fileBefore, rs.FileSize())
}

// A write in progress on the records database (the writer's transaction
// held open, as during a flood's batch) neither blocks records reads nor
// touches the main database: API keys are checked meanwhile.
func TestRecordsReadsNotBlockedByWrites(t *testing.T) {
	dir := t.TempDir()
	rs := openRecords(t, dir)
	st := openTest(t, dir)
	key, _, err := st.CreateKey("k")
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Add([]NetRecord{rec("a", 1)}, nil); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tx, err := rs.w.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec("INSERT INTO records (sandbox_id, time, kind) VALUES ('a', 1, 'dns')"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		page, err := rs.Page("a", 0, 10)
		if err == nil && len(page) != 1 {
			err = fmt.Errorf("read %d records, want the 1 committed", len(page))
		}
		if err == nil {
			_, _, err = rs.Counts("a")
		}
		if err == nil {
			_, err = st.VerifyKey(key)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("a records read or a key check waited for the records writer")
	}
}
