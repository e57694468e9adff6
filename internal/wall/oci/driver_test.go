package oci

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestGVisorFlags pins runsc's global flags: a sandbox without a network
// gets none; a networked one gets the netstack on its own namespace's veth
// (never the host's stack), with the TCP sender writing its packets itself
// (--qdisc=none, see NewGVisor); no flag that widens what a sandbox reaches.
func TestGVisorFlags(t *testing.T) {
	runsc := filepath.Join(t.TempDir(), "runsc")
	if err := os.WriteFile(runsc, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CAGE_RUNSC", runsc)
	rt := NewGVisor(Config{}).cfg.Runtime
	if rt == nil || rt.Binary != runsc {
		t.Fatalf("runtime %+v, want runsc at %s", rt, runsc)
	}
	want := map[bool][]string{
		false: {"--platform=systrap", "--network=none", "--host-uds=open", "--qdisc=none"},
		true:  {"--platform=systrap", "--network=sandbox", "--host-uds=open", "--qdisc=none"},
	}
	for networked, w := range want {
		got := rt.flags(networked)
		if !slices.Equal(got, w) {
			t.Errorf("networked %v: flags %q, want %q", networked, got, w)
		}
		for _, f := range got {
			switch f {
			case "--network=host", "--net-raw", "--host-uds=all", "--host-uds=create", "--allow-packet-socket-write", "--reproduce-nat", "--reproduce-nftables":
				t.Errorf("networked %v: flag %s widens what the sandbox reaches", networked, f)
			}
		}
	}
	// flags copies: the driver's own list keeps --network=none.
	if !slices.Equal(rt.Flags, want[false]) {
		t.Errorf("driver flags changed to %q", rt.Flags)
	}
	// The runc wall has no global flags.
	if rc := NewRunc(Config{}).cfg.Runtime; rc != nil && len(rc.Flags) != 0 {
		t.Errorf("runc flags %q, want none", rc.Flags)
	}
}
