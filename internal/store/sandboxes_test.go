package store

import "testing"

// A record's sizes are bytes in Go and MiB in their columns, as every
// daemon before bytes wrote them: a record an older daemon left is read in
// bytes, and a new record reads the same to an older daemon.
func TestSizesStoredInMiB(t *testing.T) {
	s := openTest(t, t.TempDir())
	if err := s.InsertSandbox(sample("m1")); err != nil {
		t.Fatal(err)
	}
	var mem, disk int64
	if err := s.db.QueryRow("SELECT memory_mb, disk_mb FROM sandboxes WHERE id = 'm1'").Scan(&mem, &disk); err != nil {
		t.Fatal(err)
	}
	if mem != 512 || disk != 2048 {
		t.Errorf("columns hold memory %d and disk %d, want 512 and 2048 MiB", mem, disk)
	}
	if _, err := s.db.Exec("UPDATE sandboxes SET memory_mb = 100, disk_mb = 7 WHERE id = 'm1'"); err != nil {
		t.Fatal(err)
	}
	sb, err := s.GetSandbox("m1")
	if err != nil {
		t.Fatal(err)
	}
	if sb.Memory != 100<<20 || sb.Disk != 7<<20 {
		t.Errorf("an older daemon's 100 and 7 MiB read as %d and %d bytes", sb.Memory, sb.Disk)
	}
}
