package daemontest

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
)

// TestBadInput sends the control API what a careless or hostile client
// might: each gets a 4xx with E2B's error body, never a 500 or a stack
// trace, and nothing is left on the host afterwards.
func TestBadInput(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--max-timeout", "1h", "--max-sandboxes", "1")
	key := d.key

	big := map[string]any{"templateID": "host", "metadata": map[string]string{"x": strings.Repeat("a", 2<<20)}}
	for _, c := range []struct {
		name   string
		c      call
		status int
		says   string // the message mentions it
	}{
		{"malformed JSON", call{method: "POST", path: "/v2/sandboxes", body: []byte(`{"templateID":`), invalid: true}, 400, ""},
		{"malformed JSON v1", call{method: "POST", path: "/sandboxes", body: []byte(`not json`), invalid: true}, 400, ""},
		{"a JSON array", call{method: "POST", path: "/v2/sandboxes", body: []byte(`[]`), invalid: true}, 400, ""},
		{"templateID of the wrong type", call{method: "POST", path: "/v2/sandboxes", body: []byte(`{"templateID": 5}`), invalid: true}, 400, ""},
		{"no body", call{method: "POST", path: "/v2/sandboxes", invalid: true}, 400, ""},
		{"missing templateID", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"timeout": 10}, invalid: true}, 400, "templateID"},
		{"missing templateID v1", call{method: "POST", path: "/sandboxes", body: map[string]any{}, invalid: true}, 400, "templateID"},
		{"empty templateID", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": ""}, invalid: true}, 400, "templateID"},
		{"unknown template", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "no-such-template"}}, 404, "no-such-template"},
		{"unknown template v1", call{method: "POST", path: "/sandboxes", body: map[string]any{"templateID": "no-such-template"}}, 404, "no-such-template"},
		{"timeout 0", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "timeout": 0}, invalid: true}, 400, "timeout"},
		{"negative timeout", call{method: "POST", path: "/sandboxes", body: map[string]any{"templateID": "host", "timeout": -5}, invalid: true}, 400, "timeout"},
		{"timeout above --max-timeout", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "timeout": 7200}}, 400, "timeout"},
		{"timeout above --max-timeout v1", call{method: "POST", path: "/sandboxes", body: map[string]any{"templateID": "host", "timeout": 3601}}, 400, "timeout"},
		{"memory too small", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "memoryMB": 16}}, 400, "memory"},
		{"pids too small", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "pids": 5}}, 400, "pids"},
		{"cpus too small", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "cpuCount": 0.001}}, 400, "cpu"},
		// Ceilings: above a maximum is a 400 naming it, never a 500 from
		// the host (10 TiB once reached a cgroup write) and never a value
		// that wraps (memoryMB<<20 past 2^63 was 0, the default;
		// 18446744074 s times 1e9 wrapped to a 0.29 s timeout).
		{"memory of 10 TiB", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "memoryMB": 10 << 20}}, 400, "maximum"},
		{"memoryMB that overflows bytes", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "memoryMB": int64(1) << 50}, invalid: true}, 400, "memory"},
		{"512 CPUs", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "cpuCount": 512}}, 400, "maximum"},
		{"a trillion pids", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "pids": int64(1) << 40}, invalid: true}, 400, "pids"},
		{"disk of 10 TiB", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "diskSizeMB": 10 << 20}}, 400, "maximum"},
		{"diskSizeMB that overflows bytes", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "diskSizeMB": int64(1) << 50}, invalid: true}, 400, "disk"},
		{"timeout that wraps", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "timeout": int64(18446744074)}, invalid: true}, 400, "maximum"},
		{"env var name with =", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "envVars": map[string]string{"A=B": "x"}}}, 400, "A=B"},
		{"unknown wall", call{method: "POST", path: "/v2/sandboxes", body: map[string]any{"templateID": "host", "wall": "vm"}, invalid: true}, 400, "vm"},
		{"body over 1 MiB", call{method: "POST", path: "/v2/sandboxes", body: big}, 413, ""},
		{"body over 1 MiB v1", call{method: "POST", path: "/sandboxes", body: big}, 413, ""},
		{"limit 0", call{method: "GET", path: "/v2/sandboxes?limit=0", invalid: true}, 400, "limit"},
		{"limit 101", call{method: "GET", path: "/v2/sandboxes?limit=101", invalid: true}, 400, "limit"},
		{"limit not a number", call{method: "GET", path: "/v2/sandboxes?limit=many", invalid: true}, 400, "many"},
		{"unknown state", call{method: "GET", path: "/v2/sandboxes?state=bogus", invalid: true}, 400, "bogus"},
		{"forged nextToken", call{method: "GET", path: "/v2/sandboxes?nextToken=forged"}, 400, ""},
		{"nextToken of another form", call{method: "GET", path: "/v2/sandboxes?nextToken=" + url.QueryEscape("djEuMS4uLi94")}, 400, ""},
		{"malformed metadata filter", call{method: "GET", path: "/v2/sandboxes?metadata=" + url.QueryEscape("%ZZ")}, 400, "metadata"},
		{"malformed metadata filter v1", call{method: "GET", path: "/sandboxes?metadata=" + url.QueryEscape("%ZZ")}, 400, "metadata"},
	} {
		c.c.key = key
		r := d.do(t, c.c)
		if r.status != c.status {
			t.Errorf("%s: %s %s: %v, want %d", c.name, c.c.method, c.c.path, r, c.status)
			continue
		}
		if c.says != "" && !strings.Contains(strings.ToLower(string(r.body)), strings.ToLower(c.says)) {
			t.Errorf("%s: message %s does not mention %q", c.name, r.body, c.says)
		}
	}

	// Routes the API does not have: 404 with a JSON error (the document
	// has no route to check them against).
	for _, c := range []struct{ method, path string }{
		{"GET", "/nope"}, {"GET", "/v3/sandboxes"}, {"POST", "/v2/sandboxes/x/y/z"}, {"PUT", "/sandboxes/abc"},
		{"PATCH", "/v2/sandboxes"}, {"GET", "/"}, {"GET", "/sandboxes/abc/nope"},
	} {
		req, _ := http.NewRequest(c.method, d.apiURL()+c.path, nil)
		req.Header.Set("X-API-Key", key)
		resp, err := d.http.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", c.method, c.path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		r := reply{status: resp.StatusCode, header: resp.Header, body: body}
		noStack(t, c.method+" "+c.path, string(body))
		if r.status != http.StatusNotFound && r.status != http.StatusMethodNotAllowed {
			t.Errorf("unknown route %s %s: %v, want 404", c.method, c.path, r)
		}
		checkErrorBody(t, "unknown route "+c.method+" "+c.path, r)
	}

	// --max-sandboxes 1: a second sandbox at once gets 429 with Retry-After.
	first := d.create(t, key, map[string]any{"timeout": 600})
	for _, path := range []string{"/v2/sandboxes", "/sandboxes"} {
		r := d.do(t, call{method: "POST", path: path, key: key, body: map[string]any{"templateID": "host", "timeout": 60}})
		if r.status != http.StatusTooManyRequests {
			t.Errorf("POST %s with one sandbox running and --max-sandboxes 1: %v, want 429", path, r)
			var sb types.Sandbox
			if json.Unmarshal(r.body, &sb) == nil && sb.SandboxID != "" {
				d.remember(sb.SandboxID, key)
			}
			continue
		}
		if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 0 {
			t.Errorf("429 without a Retry-After in seconds: %q", r.header.Get("Retry-After"))
		}
	}

	// The running sandbox's routes refuse bad bodies too.
	path := "/sandboxes/" + first.SandboxID
	for _, c := range []struct {
		name   string
		c      call
		status int
	}{
		{"timeout: malformed JSON", call{method: "POST", path: path + "/timeout", body: []byte(`{`), invalid: true}, 400},
		{"timeout: no timeout", call{method: "POST", path: path + "/timeout", body: map[string]any{}, invalid: true}, 400},
		{"timeout: 0", call{method: "POST", path: path + "/timeout", body: map[string]any{"timeout": 0}, invalid: true}, 400},
		{"timeout: above --max-timeout", call{method: "POST", path: path + "/timeout", body: map[string]any{"timeout": 7200}}, 400},
		{"timeout: body over 1 MiB", call{method: "POST", path: path + "/timeout", body: map[string]any{"timeout": 5, "pad": strings.Repeat("a", 2<<20)}}, 413},
		{"refresh: malformed JSON", call{method: "POST", path: path + "/refreshes", body: []byte(`{"duration":`), invalid: true}, 400},
		{"refresh: above --max-timeout", call{method: "POST", path: path + "/refreshes", body: map[string]any{"duration": 7200}}, 400},
		{"connect v1: no timeout", call{method: "POST", path: path + "/connect", body: map[string]any{}, invalid: true}, 400},
		{"connect v1: malformed JSON", call{method: "POST", path: path + "/connect", body: []byte(`]`), invalid: true}, 400},
		{"connect v2: timeout 0", call{method: "POST", path: "/v2" + path + "/connect", body: map[string]any{"timeout": 0}, invalid: true}, 400},
		{"connect v2: above --max-timeout", call{method: "POST", path: "/v2" + path + "/connect", body: map[string]any{"timeout": 7200}}, 400},
		{"metrics: start not a number", call{method: "GET", path: path + "/metrics?start=yesterday", invalid: true}, 400},
	} {
		c.c.key = key
		if r := d.do(t, c.c); r.status != c.status {
			t.Errorf("%s: %v, want %d", c.name, r, c.status)
		}
	}
	// None of that changed it.
	if got := d.get(t, key, first.SandboxID); !about(got.EndAt, 600*time.Second) {
		t.Errorf("after refused requests, endAt moved to %v from now", got.EndAt)
	}

	// Two creates at once, with room for one: exactly one gets it.
	d.kill(t, key, first.SandboxID)
	var wg sync.WaitGroup
	statuses := make([]int, 2)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body, _ := json.Marshal(map[string]any{"templateID": "host", "timeout": 60})
			req, _ := http.NewRequest(http.MethodPost, d.apiURL()+"/v2/sandboxes", bytes.NewReader(body))
			req.Header.Set("X-API-Key", key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := d.http.Do(req)
			if err != nil {
				t.Errorf("concurrent create: %v", err)
				return
			}
			data, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
			var sb types.Sandbox
			if resp.StatusCode == http.StatusCreated && json.Unmarshal(data, &sb) == nil {
				d.remember(sb.SandboxID, key)
			}
			if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
				t.Errorf("concurrent create: 429 without Retry-After")
			}
		}()
	}
	wg.Wait()
	if !(statuses[0] == 201 && statuses[1] == 429) && !(statuses[0] == 429 && statuses[1] == 201) {
		t.Errorf("two concurrent creates with --max-sandboxes 1: statuses %v, want one 201 and one 429", statuses)
	}
	for _, l := range d.list(t, key, nil) {
		d.kill(t, key, l.SandboxID)
	}

	// Sandbox ids that are not ids: 404 on every route, never 500.
	for _, id := range []string{"../x", "..", "ABC", strings.Repeat("a", 300), "a b", "a%00b", "x;rm -rf /", "é"} {
		p := "/sandboxes/" + url.PathEscape(id)
		for _, c := range []call{
			{method: "GET", path: p},
			{method: "DELETE", path: p},
			{method: "POST", path: p + "/timeout", body: map[string]any{"timeout": 5}},
			{method: "POST", path: p + "/refreshes", body: map[string]any{"duration": 5}},
			{method: "POST", path: p + "/connect", body: map[string]any{"timeout": 5}},
			{method: "POST", path: "/v2" + p + "/connect", body: map[string]any{"timeout": 5}},
			{method: "GET", path: p + "/metrics"},
		} {
			c.key = key
			if r := d.do(t, c); r.status != http.StatusNotFound {
				t.Errorf("sandbox id %q: %s %s: %v, want 404", id, c.method, c.path, r)
			}
		}
		r := d.proxyGet(t, "/health", map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": envdPort}, "")
		checkProxyError(t, r, id, "The sandbox was not found")
	}

	// Nothing is left: no sandbox listed, none in the run directory (the
	// pool is off), no cgroup of any sandbox this test made.
	if ls := d.list(t, key, nil); len(ls) != 0 {
		t.Errorf("after the bad input, sandboxes listed: %v", idsOf(ls))
	}
	if left := d.sandboxDirs(); len(left) != 0 {
		t.Errorf("after the bad input, left in %s/sandboxes: %v", d.runDir, left)
	}
	d.mu.Lock()
	var ids []string
	for id := range d.created {
		ids = append(ids, id)
	}
	d.mu.Unlock()
	for _, id := range ids {
		d.checkGone(t, id, 5*time.Second)
	}
}
