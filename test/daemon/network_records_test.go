package daemontest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/testutil"
)

// dnsFlood is a python program that sends DNS questions for random names
// under example.com to the sandbox's resolver as fast as it can for
// argv[1] seconds (reading and discarding the answers) and prints how many
// it sent.
const dnsFlood = `import socket, os, sys, time
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)
end, n = time.time() + float(sys.argv[1]), 0
while time.time() < end:
    name = os.urandom(8).hex() + ".example.com"
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00\x00\x01\x00\x01"
    try:
        s.sendto(q, (ns, 53)); n += 1
    except BlockingIOError:
        pass
    try:
        while True: s.recv(512)
    except BlockingIOError:
        pass
print(n)`

// recordsConfig writes a config with the world's resolver and a cap of
// perSandbox records per sandbox (the rate stays the default).
func recordsConfig(t *testing.T, perSandbox int) string {
	t.Helper()
	w := testutil.SharedWorld(t)
	p := filepath.Join(t.TempDir(), "cage.json")
	b, _ := json.Marshal(map[string]any{"network": map[string]any{"dns": w.Upstreams()},
		"records": map[string]any{"per_sandbox": perSandbox}})
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// latencies times n authenticated GET /sandboxes/{id}.
func (d *daemon) latencies(t *testing.T, id string, n int) stats.Stats {
	t.Helper()
	var samples []time.Duration
	for range n {
		start := time.Now()
		r := d.do(t, call{method: "GET", path: "/sandboxes/" + id, key: d.key})
		samples = append(samples, time.Since(start))
		if r.status != http.StatusOK {
			t.Fatalf("GET /sandboxes/%s during the test: %v", id, r)
		}
	}
	return stats.Summarize(samples)
}

func fileSize(paths ...string) int64 {
	var n int64
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// Attack: code in a sandbox floods the host's resolver with questions for
// random names, each of which used to become an event in the daemon's one
// database, unrated and never pruned. Expected: the sandbox's records stop
// at its cap (300 here) and the rest are counted as dropped; the records
// database stays small and the main one does not grow with them; another
// tenant's authenticated API calls are served meanwhile (their latency is
// reported, with and without the flood); the records come a page at a
// time, newest first, each once, and only to the sandbox's own key.
func TestNetworkRecordsFlood(t *testing.T) {
	const perSandbox = 300
	d := startDaemon(t, "--config", recordsConfig(t, perSandbox))
	flooder := d.create(t, d.key, nil) // E2B's default: the internet
	bystander := d.create(t, d.key, nil)
	ac := d.agent(flooder.SandboxID, flooder.EnvdAccessToken)
	defer ac.Close()
	mainDB := filepath.Join(d.data, "cage.db")
	recordsDB := filepath.Join(d.data, "records.db")
	mainBefore := fileSize(mainDB, mainDB+"-wal")

	quiet := d.latencies(t, bystander.SandboxID, 300)
	var wg sync.WaitGroup
	var flood runResult
	wg.Go(func() { flood = run(ac, fmt.Sprintf("python3 -c '%s' 12", dnsFlood)) })
	time.Sleep(2 * time.Second) // the flood is under way
	loud := d.latencies(t, bystander.SandboxID, 300)
	wg.Wait()
	if flood.err != nil || flood.exit != 0 {
		t.Fatalf("the flood: exit %d, %v, %q", flood.exit, flood.err, flood.stderr)
	}
	sent, _ := strconv.Atoi(strings.TrimSpace(flood.stdout))
	if sent < 10*perSandbox {
		t.Fatalf("the flood sent %d questions: too few to test a cap of %d", sent, perSandbox)
	}

	// Every page, newest first.
	var total int
	var dropped int64
	seen := map[string]bool{}
	var last time.Time
	next := ""
	for pages := 0; ; pages++ {
		if pages > 100 {
			t.Fatal("more than 100 pages of records")
		}
		q := url.Values{"limit": {"100"}}
		if next != "" {
			q.Set("nextToken", next)
		}
		r := d.expect(t, http.StatusOK, call{method: "GET", path: "/sandboxes/" + flooder.SandboxID + "/network/records?" + q.Encode(), key: d.key})
		var page types.NetworkRecords
		r.decode(t, &page)
		if h := r.header.Get("X-Next-Token"); h != page.NextToken {
			t.Errorf("X-Next-Token %q, body's nextToken %q", h, page.NextToken)
		}
		for _, rec := range page.Records {
			key := fmt.Sprintf("%s %s %s %s", rec.Time.Format(time.RFC3339Nano), rec.Kind, rec.Name, rec.Dest)
			if seen[key] {
				t.Errorf("record %s on two pages", key)
			}
			seen[key] = true
			if rec.Sandbox != flooder.SandboxID {
				t.Errorf("a record of %s among %s's", rec.Sandbox, flooder.SandboxID)
			}
			// Newest first in the order the daemon received them: records
			// made at once by the resolver's goroutines may swap places by
			// moments, never by a second.
			if !last.IsZero() && rec.Time.After(last.Add(time.Second)) {
				t.Errorf("records out of order: %v after %v", rec.Time, last)
			}
			if last.IsZero() || rec.Time.Before(last) {
				last = rec.Time
			}
		}
		total += len(page.Records)
		dropped = page.Dropped
		if next = page.NextToken; next == "" {
			break
		}
		if len(page.Records) != 100 {
			t.Errorf("a page of %d records before the last", len(page.Records))
		}
	}
	if total > perSandbox || total < 200 {
		t.Errorf("%d records kept of a flood of %d questions; want between the burst (200) and the cap (%d)", total, sent, perSandbox)
	}
	if dropped == 0 {
		t.Errorf("the flood of %d questions dropped no record", sent)
	}
	recordsSize := fileSize(recordsDB, recordsDB+"-wal")
	mainAfter := fileSize(mainDB, mainDB+"-wal")
	if recordsSize > 8<<20 {
		t.Errorf("records.db takes %d bytes for %d records", recordsSize, total)
	}
	if mainAfter-mainBefore > 1<<20 {
		t.Errorf("the main database grew by %d bytes during the flood", mainAfter-mainBefore)
	}
	t.Logf("flood: %d questions in 12 s; %d records kept (cap %d), %d dropped; records.db %d bytes; cage.db %d -> %d bytes",
		sent, total, perSandbox, dropped, recordsSize, mainBefore, mainAfter)
	t.Logf("GET /sandboxes/{id} (another sandbox, authenticated), quiet: %v", quiet)
	t.Logf("GET /sandboxes/{id} (another sandbox, authenticated), during the flood: %v (p99 ratio %.2f)", loud, float64(loud.P99)/float64(quiet.P99))

	// Bad cursors and limits are 400; another key sees nothing.
	for _, q := range []string{"limit=0", "limit=1001", "limit=x", "nextToken=abc", "nextToken=-5"} {
		r := d.do(t, call{method: "GET", path: "/sandboxes/" + flooder.SandboxID + "/network/records?" + q, key: d.key, invalid: true})
		if r.status != http.StatusBadRequest {
			t.Errorf("records?%s: %v, want 400", q, r)
		}
	}
	other := d.createKey(t, "other")
	if r := d.do(t, call{method: "GET", path: "/sandboxes/" + flooder.SandboxID + "/network/records", key: other}); r.status != http.StatusNotFound {
		t.Errorf("another key reads the records: %v, want 404", r)
	}
}
