package e2b

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil"
)

// TestE2BAudit runs audit.test.mjs (a session through the real SDK 2.51.0:
// commands, a background command killed, files written, read, made, moved
// and removed, a name resolved and a metadata address refused, a network
// change, a pause and resume, a snapshot, a fork, a kill and a timeout) and
// then reads the key's audit trail through GET /audit: every step is there,
// with what the SDK did, observed by the host (or, for how a process
// ended, reported by the agent), and nothing else's. The stopped daemon's
// chain verifies with `cage audit verify`.
func TestE2BAudit(t *testing.T) {
	d := startDaemon(t)
	args := []string{"--test", "--test-reporter=spec", "audit.test.mjs"}
	if err := runNode(t, sdkDir(t), d.sdkEnv("e2b", d.key), 5*time.Minute, args...); err != nil {
		t.Fatalf("the audited session through the E2B SDK: %v (the daemon's log follows the test)", err)
	}
	es := d.auditTrail(t)
	sum := sha256.Sum256([]byte("audited contents\n"))
	want := map[string]func(types.AuditEntry) bool{
		"key.create":       nil,
		"sandbox.create":   nil,
		"sandbox.network":  nil,
		"sandbox.pause":    nil,
		"sandbox.resume":   nil,
		"sandbox.snapshot": nil,
		"sandbox.fork":     nil,
		"sandbox.kill":     nil,
		"sandbox.timeout":  nil,
		"api.call": func(e types.AuditEntry) bool {
			return e.Route == "POST /sandboxes/{sandboxID}/timeout" && e.Status == 204
		},
		"process.start": func(e types.AuditEntry) bool {
			argv, _ := json.Marshal(e.Detail["argv"])
			return e.Source == "host" && strings.Contains(string(argv), "audit-marker-sdk") && e.Detail["user"] != nil
		},
		"process.end":    func(e types.AuditEntry) bool { return e.Source == "agent" && e.Detail["exit_code"] == float64(3) },
		"process.signal": func(e types.AuditEntry) bool { return e.Detail["signal"] == "SIGNAL_SIGKILL" },
		"file.write": func(e types.AuditEntry) bool {
			return e.Detail["path"] == "/tmp/audit-a.txt" && e.Detail["sha256"] == hex.EncodeToString(sum[:]) && e.Detail["size"] == float64(17)
		},
		"file.read":   func(e types.AuditEntry) bool { return e.Detail["path"] == "/tmp/audit-a.txt" },
		"file.mkdir":  func(e types.AuditEntry) bool { return e.Detail["path"] == "/tmp/audit-dir" },
		"file.move":   func(e types.AuditEntry) bool { return e.Detail["destination"] == "/tmp/audit-dir/b.txt" },
		"file.remove": func(e types.AuditEntry) bool { return e.Detail["path"] == "/tmp/audit-dir/b.txt" },
		"net.dns":     func(e types.AuditEntry) bool { return e.Detail["name"] == "allowed.example.com" },
		"net.connect": func(e types.AuditEntry) bool {
			return e.Detail["decision"] == "deny" && strings.HasPrefix(fmt.Sprint(e.Detail["dest"]), "169.254.169.254")
		},
	}
	for kind, match := range want {
		found := false
		for _, e := range es {
			if e.Kind == kind && (match == nil || match(e)) {
				found = true
				break
			}
		}
		if !found {
			var of []string
			for _, e := range es {
				if e.Kind == kind {
					b, _ := json.Marshal(e)
					of = append(of, string(b))
				}
			}
			t.Errorf("no matching %s entry in the key's trail; those of its kind:\n%s", kind, strings.Join(of, "\n"))
		}
	}
	key := es[0].KeyID
	for _, e := range es {
		if e.KeyID != key || e.Hash == "" || e.Prev == "" {
			t.Errorf("entry %d (%s): key %q, hash %q, prev %q", e.Seq, e.Kind, e.KeyID, e.Hash, e.Prev)
		}
	}
	d.checkNoSandboxesLeft(t)
	d.stop(t)
	out, err := cageCommand(context.Background(), testutil.Binaries(t)+"/cage", "audit", "verify", "--data", d.data).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK: the chain holds") {
		t.Fatalf("cage audit verify: %v\n%s", err, out)
	}
	t.Logf("cage audit verify: %s", out)
}

// auditTrail reads the daemon's whole trail for its key, a page at a time.
func (d *daemon) auditTrail(t *testing.T) []types.AuditEntry {
	t.Helper()
	var all []types.AuditEntry
	q := url.Values{"limit": {"1000"}}
	for {
		req, _ := http.NewRequest(http.MethodGet, d.apiURL+"/audit?"+q.Encode(), nil)
		req.Header.Set("X-API-Key", d.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var page types.AuditPage
		err = json.NewDecoder(resp.Body).Decode(&page)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /audit: %d %v", resp.StatusCode, err)
		}
		all = append(all, page.Entries...)
		if page.NextToken == "" {
			return all
		}
		q.Set("nextToken", page.NextToken)
	}
}
