package store

import (
	"errors"
	"slices"
	"testing"
)

// TestGetSandboxAccess: what the proxy reads of a record on every request
// is the record's own, without its metadata or environment.
func TestGetSandboxAccess(t *testing.T) {
	s := openTest(t, t.TempDir())
	sb := sample("a1")
	sb.HTTPSPorts, sb.PublicTraffic, sb.AutoResume, sb.State = []int{8443}, true, true, StatePaused
	sb.Metadata = map[string]string{"big": "x"}
	if err := s.InsertSandbox(sb); err != nil {
		t.Fatal(err)
	}
	a, err := s.GetSandboxAccess("a1")
	if err != nil {
		t.Fatal(err)
	}
	if a.KeyID != sb.KeyID || a.State != StatePaused || a.AccessToken != sb.AccessToken || a.TrafficToken != sb.TrafficToken ||
		!a.PublicTraffic || !a.AutoResume || !slices.Equal(a.HTTPSPorts, []int{8443}) {
		t.Errorf("access %+v of record %+v", a, sb)
	}
	if _, err := s.GetSandboxAccess("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("a missing sandbox: %v, want ErrNotFound", err)
	}
}
