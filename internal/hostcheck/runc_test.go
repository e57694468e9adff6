package hostcheck

import (
	"os/exec"
	"strings"
	"testing"
)

// TestRuncCheck: the runc line says, from the version and (Debian's
// build) the package's changelog, whether runc carries the fixes of
// November 2025, and never fails the check for an old one.
func TestRuncCheck(t *testing.T) {
	debian := "runc version 1.1.5+ds1\ncommit: 1.1.5+ds1-1+deb12u1\nspec: 1.0.2-dev\n"
	oldLog := []byte("runc (1.1.5+ds1-1+deb12u1) bookworm-security; urgency=high\n\n  * CVE-2024-21626: leaked fds\n")
	fixedLog := append([]byte("runc (1.1.5+ds1-1+deb12u2) bookworm-security\n  * CVE-2025-31133, CVE-2025-52565, CVE-2025-52881\n"), oldLog...)
	someLog := append([]byte("  * CVE-2025-31133\n"), oldLog...)
	for _, c := range []struct {
		name, version string
		changelog     []byte
		fixed         bool
		says          []string
	}{
		{"debian old", debian, oldLog, false, []string{"Debian 1.1.5+ds1-1+deb12u1", "not known to carry", "changelog names none", "CVE-2025-31133", "docs/SECURITY.md"}},
		{"debian backport", debian, fixedLog, true, []string{"changelog names the fixes", "CVE-2025-52881"}},
		{"debian some", debian, someLog, false, []string{"names CVE-2025-31133 only", "fixes for CVE-2025-52565, CVE-2025-52881"}},
		{"upstream 1.1.15", "runc version 1.1.15\ncommit: v1.1.15-0-gbc20cb44\n", nil, false, []string{"upstream build before 1.2.8"}},
		{"upstream 1.2.7", "runc version 1.2.7\n", nil, false, nil},
		{"upstream 1.2.8", "runc version 1.2.8\ncommit: v1.2.8-0-g\n", nil, true, []string{"carries the fixes"}},
		{"upstream 1.3.2", "runc version 1.3.2\n", nil, false, nil},
		{"upstream 1.3.3", "runc version 1.3.3\n", nil, true, nil},
		{"upstream 1.4.0-rc.2", "runc version 1.4.0-rc.2\n", nil, false, nil},
		{"upstream 1.4.0-rc.3", "runc version 1.4.0-rc.3\n", nil, true, nil},
		{"upstream 1.4.1", "runc version 1.4.1\n", nil, true, nil},
		{"garbage", "what?\n", nil, false, []string{"version unknown"}},
	} {
		got := runcCheck("/usr/sbin/runc", c.version, c.changelog)
		if !got.OK || got.Name != "runc" {
			t.Errorf("%s: %+v, want an ok line named runc", c.name, got)
		}
		if fixed := !strings.Contains(got.Info, "not known to carry") && !strings.Contains(got.Info, "unknown"); fixed != c.fixed {
			t.Errorf("%s: %q: fixed %v, want %v", c.name, got.Info, fixed, c.fixed)
		}
		for _, s := range c.says {
			if !strings.Contains(got.Info, s) {
				t.Errorf("%s: %q, want it to say %q", c.name, got.Info, s)
			}
		}
	}
}

// TestRuncHere: this host's runc, read as doctor reads it.
func TestRuncHere(t *testing.T) {
	if _, err := exec.LookPath("runc"); err != nil {
		t.Skip("no runc here")
	}
	c, ok := Runc()
	if !ok || !c.OK || !strings.HasPrefix(c.Info, "runc ") {
		t.Fatalf("%+v (%v), want an ok line naming runc's version", c, ok)
	}
	t.Log(c.Info)
}
