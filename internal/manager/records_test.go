package manager

import (
	"errors"
	"testing"

	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/store"
)

func newRecorder(t *testing.T, lim RecordLimits) (*Manager, *store.Records) {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	db, err := store.OpenRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	m := New(Config{Store: st})
	m.StartRecords(db, lim)
	t.Cleanup(m.StopRecords)
	return m, db
}

// Attack: a sandbox makes records as fast as it can (a DNS flood). Expected:
// its burst is kept and the rest counted as dropped, another sandbox's
// records are kept all the same, and no sandbox keeps more than its cap
// however slowly its records come.
func TestRecordsRateAndCap(t *testing.T) {
	m, db := newRecorder(t, RecordLimits{Rate: 1, Burst: 50, PerSandbox: 80})
	for range 1000 {
		m.NetRecord(network.Record{Sandbox: "flood", Kind: "dns", Decision: "allow", Name: "x.example.com"})
	}
	for range 10 {
		m.NetRecord(network.Record{Sandbox: "quiet", Kind: "connect", Decision: "deny", Dest: "169.254.169.254:80"})
	}
	m.FlushRecords()
	kept, dropped, err := db.Counts("flood")
	if err != nil || kept != 50 || dropped != 950 {
		t.Errorf("flood: %d kept, %d dropped, %v; want the burst (50) kept and 950 dropped", kept, dropped, err)
	}
	if kept, dropped, _ := db.Counts("quiet"); kept != 10 || dropped != 0 {
		t.Errorf("quiet sandbox: %d kept, %d dropped; want all 10 kept", kept, dropped)
	}
	// The cap: a sandbox within its rate still stops at PerSandbox.
	m2, db2 := newRecorder(t, RecordLimits{Rate: 1e6, Burst: 1e6, PerSandbox: 80})
	for range 200 {
		m2.NetRecord(network.Record{Sandbox: "s", Kind: "dns", Decision: "deny", Name: "y.example.com"})
	}
	m2.FlushRecords()
	if kept, dropped, _ := db2.Counts("s"); kept != 80 || dropped != 120 {
		t.Errorf("cap: %d kept, %d dropped; want 80 and 120", kept, dropped)
	}
	if page, _ := db2.Page("s", 0, 1000); len(page) != 80 {
		t.Errorf("cap: %d records stored, want 80", len(page))
	}
}

// A cursor the server did not give, and limits out of range, are refused
// before anything is read.
func TestNetRecordsBadInput(t *testing.T) {
	m, _ := newRecorder(t, RecordLimits{})
	for _, c := range []struct {
		limit  int
		cursor string
	}{{0, ""}, {MaxRecordsPage + 1, ""}, {10, "abc"}, {10, "-1"}, {10, "0"}, {10, "99999999999999999999"}} {
		if _, err := m.NetRecords("", "nosuch", c.limit, c.cursor); err == nil || !isInvalid(err) {
			t.Errorf("limit %d cursor %q: %v, want ErrInvalid", c.limit, c.cursor, err)
		}
	}
	if _, err := m.NetRecords("", "nosuch", 10, ""); err == nil || isInvalid(err) {
		t.Errorf("an unknown sandbox: %v, want not found", err)
	}
}

func isInvalid(err error) bool { return errors.Is(err, ErrInvalid) }
