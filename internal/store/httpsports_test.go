package store

import (
	"slices"
	"testing"
)

// A sandbox's httpsPorts are kept with its record, through updates (a
// pause rewrites the row), and a record without any reads as none.
func TestHTTPSPortsKept(t *testing.T) {
	s := openTest(t, t.TempDir())
	sb := sample("h1")
	sb.HTTPSPorts = []int{8443, 9443}
	if err := s.InsertSandbox(sb); err != nil {
		t.Fatal(err)
	}
	if err := s.InsertSandbox(sample("h2")); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetSandbox("h1")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.HTTPSPorts, []int{8443, 9443}) {
		t.Errorf("httpsPorts read back %v, want [8443 9443]", got.HTTPSPorts)
	}
	got.State = StatePaused
	if err := s.UpdateSandbox(got); err != nil {
		t.Fatal(err)
	}
	if again, err := s.GetSandbox("h1"); err != nil || !slices.Equal(again.HTTPSPorts, []int{8443, 9443}) {
		t.Errorf("after an update httpsPorts %v (err %v), want [8443 9443]", again.HTTPSPorts, err)
	}
	if none, err := s.GetSandbox("h2"); err != nil || none.HTTPSPorts != nil {
		t.Errorf("a sandbox without httpsPorts reads %v (err %v), want none", none.HTTPSPorts, err)
	}
	var col string
	if err := s.db.QueryRow("SELECT https_ports FROM sandboxes WHERE id = 'h2'").Scan(&col); err != nil || col != "[]" {
		t.Errorf("https_ports column of a sandbox without: %q (err %v), want []", col, err)
	}
}
