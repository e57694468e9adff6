package abuse

import (
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// call sends an API request and returns the status, the Retry-After
// header and the body.
func call(t *testing.T, d *cageserve.Daemon, method, path, key string, body any) (int, string, string) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = strings.NewReader(string(b))
	}
	req, _ := http.NewRequest(method, "http://"+d.API+path, rd)
	req.Header.Set("X-API-Key", key)
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.HTTP.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
}

// refusedByQuota checks a 429 that names the quota and has no Retry-After.
func refusedByQuota(t *testing.T, what string, status int, retry, body, quota string) {
	t.Helper()
	var e types.Error
	_ = json.Unmarshal([]byte(body), &e)
	if status != http.StatusTooManyRequests || e.Code != 429 || retry != "" || !strings.Contains(e.Message, quota) {
		t.Errorf("%s: %d (Retry-After %q) %s; want 429 naming %q, no Retry-After", what, status, retry, body, quota)
	}
}

// TestTeamQuotas: a team's quotas are hit exactly at their limit, at
// create, fork, resume and pause, with E2B's error shape naming the quota,
// and a kill frees a place. Another team is not held by them.
func TestTeamQuotas(t *testing.T) {
	d := cageserve.Start(t)
	newTeam(t, d, "capped", "--sandboxes", "2", "--paused", "1")
	newTeam(t, d, "mem", "--memory", "1G")
	k, other, mk := d.NewKeyIn(t, "k", "capped"), d.Key, d.NewKeyIn(t, "m", "mem")
	body := map[string]any{"templateID": "host", "timeout": 300}

	s1, s2 := d.Create(t, k, body), d.Create(t, k, body)
	st, retry, out := call(t, d, "POST", "/v2/sandboxes", k, body)
	refusedByQuota(t, "the third create", st, retry, out, `team "capped"'s quota of 2 concurrent sandboxes`)
	d.Create(t, other, body) // a key without a team: no quota of capped's

	// A fork of two, with no place: both forks refused, naming the quota.
	st, _, out = call(t, d, "POST", "/sandboxes/"+s1.SandboxID+"/fork", k, map[string]any{"count": 2, "timeout": 60})
	var forks []types.SandboxForkResult
	if st != http.StatusCreated || json.Unmarshal([]byte(out), &forks) != nil || len(forks) != 2 {
		t.Fatalf("fork: %d %s", st, out)
	}
	for _, f := range forks {
		if f.Error.Code != 429 || !strings.Contains(f.Error.Message, "quota of 2 concurrent sandboxes") {
			t.Errorf("a fork over the quota: %+v", f)
		}
	}

	// A kill frees a place, exactly one.
	d.Kill(k, s2.SandboxID)
	s3 := d.Create(t, k, body)
	st, retry, out = call(t, d, "POST", "/v2/sandboxes", k, body)
	refusedByQuota(t, "a create after the freed place was taken", st, retry, out, "concurrent sandboxes")

	// Paused: one may be paused; a second pause is refused and the
	// sandbox runs on.
	if st, _, out := call(t, d, "POST", "/sandboxes/"+s1.SandboxID+"/pause", k, map[string]any{"memory": false}); st != http.StatusNoContent {
		t.Fatalf("pause: %d %s", st, out)
	}
	st, retry, out = call(t, d, "POST", "/sandboxes/"+s3.SandboxID+"/pause", k, map[string]any{"memory": false})
	refusedByQuota(t, "a second pause", st, retry, out, "quota of 1 paused sandboxes")
	if sd := detail(t, d, k, s3.SandboxID); sd.State != "running" {
		t.Errorf("the sandbox whose pause was refused is %s", sd.State)
	}
	// Resume needs a running place: s3 and a new one hold both.
	s4 := d.Create(t, k, body)
	st, retry, out = call(t, d, "POST", "/sandboxes/"+s1.SandboxID+"/resume", k, map[string]any{"timeout": 60})
	refusedByQuota(t, "a resume with no place", st, retry, out, "concurrent sandboxes")
	st, retry, out = call(t, d, "POST", "/v2/sandboxes/"+s1.SandboxID+"/connect", k, map[string]any{"timeout": 60})
	refusedByQuota(t, "a connect that would resume, with no place", st, retry, out, "concurrent sandboxes")
	d.Kill(k, s4.SandboxID)
	if st, _, out := call(t, d, "POST", "/sandboxes/"+s1.SandboxID+"/resume", k, map[string]any{"timeout": 60}); st != http.StatusCreated {
		t.Errorf("resume once a place is free: %d %s", st, out)
	}

	// Memory: two of 512 MiB fit 1 GiB, a third does not; 256 MiB does not either.
	m := map[string]any{"templateID": "host", "timeout": 300, "memoryMB": 512}
	d.Create(t, mk, m)
	d.Create(t, mk, m)
	m["memoryMB"] = 256
	st, retry, out = call(t, d, "POST", "/v2/sandboxes", mk, m)
	refusedByQuota(t, "a create over the memory quota", st, retry, out, `team "mem"'s quota of 1024 MiB memory is reached (1024 MiB in use, 256 MiB asked)`)

	// What a team holds, as the admin API says.
	admin := d.NewKeyIn(t, "ops", "admin")
	st, _, out = call(t, d, "GET", "/admin/teams/capped", admin, nil)
	var team types.Team
	if st != 200 || json.Unmarshal([]byte(out), &team) != nil || team.Usage.Sandboxes != 2 || team.Quotas.Sandboxes != 2 ||
		team.Usage.Paused != 0 {
		t.Errorf("GET /admin/teams/capped: %d %s", st, out)
	}
}

// TestKeyRateLimits: an admin sets a team's rates through the API; a key
// over its request rate gets 429 with Retry-After before its body is
// read, and is served again after waiting that long; a key over its
// create rate likewise, and another key of the same team has buckets of
// its own. The server's defaults hold for a key without a team.
func TestKeyRateLimits(t *testing.T) {
	d := cageserve.Start(t)
	admin := d.NewKeyIn(t, "ops", "admin")
	st, _, out := call(t, d, "POST", "/admin/teams", admin, map[string]any{"name": "slow",
		"rateLimits": map[string]any{"requestsPerSecond": 5, "createsPerSecond": 0.25}})
	if st != http.StatusCreated {
		t.Fatalf("POST /admin/teams: %d %s", st, out)
	}
	st, _, out = call(t, d, "POST", "/admin/keys", admin, map[string]any{"name": "s1", "teamID": "slow"})
	var ck types.CreatedAPIKey
	if st != http.StatusCreated || json.Unmarshal([]byte(out), &ck) != nil || !strings.HasPrefix(ck.Key, "e2b_") || ck.TeamID == "" {
		t.Fatalf("POST /admin/keys: %d %s", st, out)
	}
	key, key2 := ck.Key, d.NewKeyIn(t, "s2", "slow")

	// Requests: a burst of 10 (twice the rate), then 429 with Retry-After.
	// The bucket refills at 5 a second while they go: one by one, on a
	// slow host, they earn more than the burst (14 of them in 0.4 s were
	// enough for a 12th), so they go until three are refused, and what is
	// served is bounded by the time they took.
	ok, limited, retry := 0, 0, ""
	start := time.Now()
	for i := 0; limited < 3 && i < 200; i++ {
		st, ra, body := call(t, d, "GET", "/v2/sandboxes", key, nil)
		switch st {
		case http.StatusOK:
			ok++
		case http.StatusTooManyRequests:
			limited++
			retry = ra
			if !strings.Contains(body, "rate limit") || !strings.Contains(body, `"code":429`) {
				t.Errorf("429 body: %s", body)
			}
		default:
			t.Fatalf("GET: %d %s", st, body)
		}
	}
	took := time.Since(start)
	if most := 11 + int(5*took.Seconds()); ok < 10 || ok > most || limited < 3 || retry != "1" {
		t.Errorf("requests at 5/s for %v: %d served, %d refused (Retry-After %q); want 10 to %d served (the burst and what %v earns), then 429 with Retry-After 1",
			took.Round(time.Millisecond), ok, limited, retry, most, took.Round(time.Millisecond))
	}
	// A refused request's body is never read: a large one is refused
	// all the same, at once. Not on key: its bucket refills at 5 a second,
	// and a refusal leaves it up to a token short, so a create sent a few
	// ms later could find a token (then 400: its body is read). A key of
	// a team at 0.01 a second (a burst of 1) earns none for 100 s.
	st, _, out = call(t, d, "POST", "/admin/teams", admin, map[string]any{"name": "glacial",
		"rateLimits": map[string]any{"requestsPerSecond": 0.01}})
	if st != http.StatusCreated {
		t.Fatalf("POST /admin/teams: %d %s", st, out)
	}
	gk := d.NewKeyIn(t, "g1", "glacial")
	if st, _, body := call(t, d, "GET", "/v2/sandboxes", gk, nil); st != http.StatusOK {
		t.Fatalf("a key at 0.01/s, its first request: %d %s", st, body)
	}
	big := map[string]any{"templateID": "host", "metadata": map[string]string{"pad": strings.Repeat("x", 512<<10)}}
	if st, ra, _ := call(t, d, "POST", "/v2/sandboxes", gk, big); st != http.StatusTooManyRequests || ra == "" {
		t.Errorf("a create over the request rate: %d (Retry-After %q)", st, ra)
	}
	if st, _, body := call(t, d, "GET", "/v2/sandboxes", key2, nil); st != http.StatusOK {
		t.Errorf("the team's other key while the first is limited: %d %s", st, body)
	}
	wait, _ := strconv.Atoi(retry)
	time.Sleep(time.Duration(wait) * time.Second)
	if st, _, body := call(t, d, "GET", "/v2/sandboxes", key, nil); st != http.StatusOK {
		t.Errorf("after Retry-After: %d %s", st, body)
	}

	// Creates: a burst of 1 at 0.25/s, then 429 with Retry-After the 4 s
	// the next token takes less the time since the first create took its
	// token, in whole seconds up: 4, or less where the first create was
	// slow (a loaded host), as the time measured says. Then a create
	// after waiting that long is served.
	body := map[string]any{"templateID": "host", "timeout": 60}
	first := time.Now()
	d.Create(t, key2, body)
	st, ra, msg := call(t, d, "POST", "/v2/sandboxes", key2, body)
	since := time.Since(first)
	secs, err := strconv.Atoi(ra)
	least := max(1, int(math.Ceil((4*time.Second - since).Seconds())))
	if st != http.StatusTooManyRequests || err != nil || secs < least || secs > 4 || !strings.Contains(msg, "creates a second") {
		t.Errorf("a second create at 0.25/s, %v after the first began: %d (Retry-After %q) %s; want 429 with Retry-After %d to 4",
			since.Round(time.Millisecond), st, ra, msg, least)
	}
	time.Sleep(time.Duration(secs) * time.Second)
	d.Create(t, key2, body)

	// The server's defaults for a key without a team: 30 requests at once
	// pass (its burst is 2,000).
	for i := range 30 {
		if st, _, body := call(t, d, "GET", "/v2/sandboxes", d.Key, nil); st != http.StatusOK {
			t.Fatalf("request %d of a key without a team: %d %s", i, st, body)
		}
	}
}
