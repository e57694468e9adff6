package abuse

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// stateOf is a sandbox's state as the API reports it.
func stateOf(t *testing.T, d *cageserve.Daemon, key, id string) types.SandboxDetail {
	t.Helper()
	st, out, err := d.Do("GET", "/sandboxes/"+id, key, nil)
	if err != nil || st != http.StatusOK {
		t.Fatalf("GET %s: %d %v %s", id, st, err, out)
	}
	var sd types.SandboxDetail
	if err := json.Unmarshal(out, &sd); err != nil {
		t.Fatal(err)
	}
	return sd
}

// TestNetworkUpdateRacingTheLifecycle: a network update sent with a pause
// or a resume never undoes it (it wrote back the whole record it had read
// before: found by review, 2026-12-03). After a pause and a resume that
// both succeeded, the sandbox is running and counts against its team's
// quota (recorded paused, it ran outside it: a second sandbox of a team
// capped at one); after a pause that succeeded, it is paused (a sandbox
// paused with its files, destroyed, was recorded running: kill answered
// 404, its archive stayed on disk for good). Each round's two requests
// are sent at once, the second a little later each round.
func TestNetworkUpdateRacingTheLifecycle(t *testing.T) {
	d := cageserve.Start(t)
	newTeam(t, d, "racer", "--sandboxes", "1")
	k := d.NewKeyIn(t, "k", "racer")
	policies := []map[string]any{
		{"allowOut": []string{"a.example.com"}, "denyOut": []string{"0.0.0.0/0"}},
		{"allowInternetAccess": true},
	}
	both := func(a, b func() int, delay time.Duration) (int, int) {
		var wg sync.WaitGroup
		var sa, sb int
		wg.Add(2)
		go func() { defer wg.Done(); sa = a() }()
		go func() { defer wg.Done(); time.Sleep(delay); sb = b() }()
		wg.Wait()
		return sa, sb
	}
	body := map[string]any{"templateID": "host", "timeout": 600}
	s := d.Create(t, k, body)
	path := "/sandboxes/" + s.SandboxID
	for i := range 20 {
		if st, _, out := call(t, d, "POST", path+"/pause", k, map[string]any{}); st != http.StatusNoContent {
			t.Fatalf("round %d: pause: %d %s", i, st, out)
		}
		net, con := both(
			func() int { st, _, _ := d.Do("PUT", path+"/network", k, policies[i%2]); return st },
			func() int {
				st, _, _ := d.Do("POST", "/v2"+path+"/connect", k, map[string]any{"timeout": 600})
				return st
			},
			time.Duration(i%10)*time.Millisecond)
		if con != http.StatusCreated && con != http.StatusOK {
			t.Fatalf("round %d: the resume: %d", i, con)
		}
		if sd := stateOf(t, d, k, s.SandboxID); sd.State != "running" {
			t.Fatalf("round %d: resumed (%d, the network update %d), yet recorded %q", i, con, net, sd.State)
		}
		if st, _, _ := call(t, d, "POST", "/v2/sandboxes", k, body); st != http.StatusTooManyRequests {
			t.Fatalf("round %d: a second sandbox of a team capped at one: %d, want 429", i, st)
		}
	}
	d.Kill(k, s.SandboxID)

	for i := range 20 {
		s := d.Create(t, k, body)
		path := "/sandboxes/" + s.SandboxID
		memory := i%2 == 1
		pause, net := both(
			func() int { st, _, _ := d.Do("POST", path+"/pause", k, map[string]any{"memory": memory}); return st },
			func() int { st, _, _ := d.Do("PUT", path+"/network", k, policies[i%2]); return st },
			time.Duration(i%8)*2*time.Millisecond)
		if pause != http.StatusNoContent {
			t.Fatalf("round %d: pause (memory %v): %d", i, memory, pause)
		}
		if sd := stateOf(t, d, k, s.SandboxID); sd.State != "paused" {
			t.Fatalf("round %d: paused (memory %v; the network update %d), yet recorded %q", i, memory, net, sd.State)
		}
		if st, _, out := call(t, d, "DELETE", path, k, nil); st != http.StatusNoContent {
			t.Fatalf("round %d: kill of the paused sandbox: %d %s", i, st, out)
		}
		if _, err := os.Stat(filepath.Join(d.Data, "paused", s.SandboxID+".tar")); err == nil {
			t.Fatalf("round %d: its archive is left after the kill", i)
		}
	}
}

// TestForkPaysItsCreates: a fork of n sandboxes costs n of the key's
// create tokens; more than a burst is refused outright, whatever the
// bucket holds (a fork of 12 once cost one token).
func TestForkPaysItsCreates(t *testing.T) {
	d := cageserve.Start(t)
	newTeam(t, d, "slow", "--creates", "0.1") // bursts of 1
	k := d.NewKeyIn(t, "k", "slow")
	s := d.Create(t, k, map[string]any{"templateID": "host", "timeout": 300})
	st, _, out := call(t, d, "POST", "/sandboxes/"+s.SandboxID+"/fork", k, map[string]any{"count": 2, "timeout": 60})
	if st != http.StatusTooManyRequests || !strings.Contains(out, "a fork of 2 is more than a burst") {
		t.Fatalf("a fork of 2 by a key with bursts of 1: %d %s", st, out)
	}
	if st, _, out := call(t, d, "GET", "/sandboxes", k, nil); st != http.StatusOK || strings.Count(out, `"sandboxID"`) != 1 {
		t.Fatalf("the key's sandboxes after the refused fork: %d %s", st, out)
	}
}

// TestRecordStringsBounded: a sandbox's metadata and environment are
// bounded (256 entries, names of 256 bytes, values of 16 KiB, 64 KiB in
// all, each), with a one-line 400 naming the bound: they are in its
// record, listed and sent back whole (0.5 MB of each once made every
// request anyone sent to the sandbox through the proxy 27 times dearer).
func TestRecordStringsBounded(t *testing.T) {
	d := cageserve.Start(t)
	k := d.NewKey(t, "k")
	many := map[string]string{}
	for i := range 257 {
		many["k"+strconv.Itoa(i)] = "v"
	}
	wide := map[string]string{}
	for i := range 5 {
		wide["k"+strconv.Itoa(i)] = strings.Repeat("v", 15<<10)
	}
	for _, c := range []struct {
		name string
		body map[string]any
		want string
	}{
		{"257 metadata entries", map[string]any{"metadata": many}, "metadata: 257 entries, at most 256"},
		{"a long name", map[string]any{"envVars": map[string]string{strings.Repeat("N", 257): "v"}}, "envVars: a name of 257 bytes"},
		{"a long value", map[string]any{"metadata": map[string]string{"m": strings.Repeat("v", 16<<10+1)}}, "is 16385 bytes, at most 16384"},
		{"75 KiB in all", map[string]any{"envVars": wide}, "envVars: 76810 bytes in all, at most 65536"},
	} {
		c.body["templateID"] = "host"
		st, _, out := call(t, d, "POST", "/sandboxes", k, c.body)
		if st != http.StatusBadRequest || !strings.Contains(out, c.want) || strings.Count(out, "\n") > 1 {
			t.Errorf("%s: %d %s; want 400 saying %q", c.name, st, out, c.want)
		}
	}
	if st, _, out := call(t, d, "GET", "/sandboxes", k, nil); st != http.StatusOK || strings.Contains(out, "sandboxID") {
		t.Errorf("sandboxes after the refused creates: %d %s", st, out)
	}
	ok := map[string]any{"templateID": "host", "metadata": map[string]string{"m": strings.Repeat("v", 16<<10)}}
	if st, _, out := call(t, d, "POST", "/sandboxes", k, ok); st != http.StatusCreated {
		t.Errorf("a value of 16 KiB: %d %s", st, out)
	}
}

// TestMalformedTemplateName: a template name that cannot be one is a
// one-line 400 that quotes at most 64 characters of it (it was a 500, with
// the whole name, up to the 1 MiB body, in the daemon's log at ERROR).
func TestMalformedTemplateName(t *testing.T) {
	d := cageserve.Start(t)
	for _, name := range []string{"MyTemplate", "x/y", "a..b", strings.Repeat("a", 900_000)} {
		st, _, out := call(t, d, "POST", "/v2/sandboxes", d.Key, map[string]any{"templateID": name})
		if st != http.StatusBadRequest || len(out) > 512 || strings.Count(out, "\n") > 1 {
			t.Errorf("templateID of %d bytes (%.12s): %d %.200s; want a short 400", len(name), name, st, out)
		}
	}
}
