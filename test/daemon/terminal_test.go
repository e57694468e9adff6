package daemontest

import (
	"net/http"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// What others chose never drives the operator's terminal: a path anyone
// sent the proxy (recorded as a proxy.denied route), a user name a tenant
// asked for (a process.start entry, and the agent's refusal quoting it)
// and metadata reach `cage audit`, `cage exec`'s error and `cage inspect`
// with their control characters escaped. Before, `cage audit --data` wrote
// an anonymous caller's ESC ] 52 (the clipboard), ESC ] 0 (the title) and
// a CR LF that forged a row.
func TestCLIEscapesControls(t *testing.T) {
	d := startDaemon(t)
	sb := strings.TrimSpace(d.cageOK(t, d.key, "create", "--timeout", "2m", "--metadata", "note=a\x1b]0;meta\x07b"))
	d.remember(sb, d.key)

	evil := "/x%1b]0;TITLE%07%1b]52;c;ZWNobyBwd25lZA==%07%1b[2K%0d%0aFAKE-ROW%c2%9b"
	if r := d.proxyGet(t, evil, map[string]string{"E2b-Sandbox-Id": sb}, ""); r.status != http.StatusUnauthorized {
		t.Fatalf("proxy without a token: %v", r)
	}
	user := "u\x1b]0;user\x07"
	r := d.cli(t, d.key, "exec", "--user", user, sb, "--", "true")
	if r.code == 0 {
		t.Fatalf("exec as a user who does not exist: %v", r)
	}
	clean := func(what, s string) {
		t.Helper()
		for _, c := range []string{"\x1b", "\x07", "\r", "\u009b"} {
			if strings.Contains(s, c) {
				t.Errorf("%s wrote %q to the terminal: %q", what, c, s)
			}
		}
	}
	clean("cage exec's error", r.stderr)
	if !strings.Contains(r.stderr, `\x1b]0;user`) {
		t.Errorf("cage exec's error does not show the user escaped: %q", r.stderr)
	}
	d.waitAudit(t, d.key, "process.start", func(e types.AuditEntry) bool { return detailHas(e, `]0;user`) })

	out := d.cageOK(t, "", "audit", "--data", d.data, "--kind", "proxy,process")
	clean("cage audit", out)
	for _, want := range []string{`GET /x\x1b]0;TITLE\x07\x1b]52;c;`, `\x0d\x0aFAKE-ROW\u009b`, `as u\x1b]0;user\x07`} {
		if !strings.Contains(out, want) {
			t.Errorf("cage audit shows no %s:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "FAKE-ROW") {
			t.Errorf("a forged row: %q", line)
		}
	}
	clean("cage audit (the key's own trail)", d.cageOK(t, d.key, "audit", "--kind", "process"))
	insp := d.cageOK(t, d.key, "inspect", sb)
	clean("cage inspect", insp)
	if !strings.Contains(insp, `note=a\x1b]0;meta\x07b`) {
		t.Errorf("cage inspect does not show the metadata escaped:\n%s", insp)
	}
}
