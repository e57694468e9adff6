package daemontest

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil"
)

// deepTree makes, in the sandbox, a tree 700 directories deep with 150
// files at its bottom. Its restore once took the agent minutes (it checked
// every directory of each entry's path, a cost that grew with the square
// of the depth; it now goes down the tree by descriptors, once); at the
// sandbox's own CPU bound, 2% of a core here, it still takes seconds: a
// restore takes as long as its files, and its owner's limits, make it.
const deepTree = `d=/home/user/deep/$(printf 'a/%.0s' $(seq 700)) && mkdir -p "$d" && cd "$d" && touch $(seq -f f%g 150) && echo made`

// Attack (any tenant, no compromise needed): a sandbox makes a tree some
// hundreds of directories deep (or as many files as its disk holds, on
// as little CPU as a create may ask for), and its owner pauses it without
// memory and resumes it, or forks it. The restore of its files into the
// new sandbox took its agent minutes, and the host held, for all that
// time, one of its create slots, which every tenant's creates wait for,
// and the volume lock, which every tenant's volume creates and deletes
// wait for: a few such resumes or forks stalled every other tenant's
// creates and volumes. Expected: with one create slot on the host,
// another key creates a sandbox and a volume while the restores (a resume
// from files, then a fork) still run.
func TestSlowRestoreHoldsNoHostSlot(t *testing.T) {
	t.Parallel()
	w := testutil.SharedWorld(t)
	cfg := filepath.Join(t.TempDir(), "cage.json")
	b, _ := json.Marshal(map[string]any{"network": map[string]any{"dns": w.Upstreams()}, "limits": map[string]any{"creating": 1}})
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--config", cfg)
	other := d.createKey(t, "other")
	d.expect(t, http.StatusCreated, call{method: "POST", path: "/volumes", key: d.key, body: map[string]any{"name": "deep"}})
	sb := d.create(t, d.key, map[string]any{"timeout": 600, "cpuCount": 0.02,
		"volumeMounts": []map[string]string{{"name": "deep", "path": "/mnt/deep"}}})
	id, path := sb.SandboxID, "/sandboxes/"+sb.SandboxID
	ac := d.agent(id, sb.EnvdAccessToken)
	out := mustRun(t, ac, deepTree)
	ac.Close()
	if out != "made\n" {
		t.Fatalf("the deep tree: %q", out)
	}

	// slow runs req in the background and, while it still runs, another
	// key's create and volume create.
	type result struct {
		code int
		body []byte
	}
	slow := func(what, method, route string, body any) []byte {
		t.Helper()
		done := make(chan result, 1)
		started := time.Now()
		go func() {
			b, _ := json.Marshal(body)
			req, _ := http.NewRequest(method, d.apiURL()+route, bytes.NewReader(b))
			req.Header.Set("X-API-Key", d.key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := (&http.Client{Timeout: 10 * time.Minute}).Do(req)
			if err != nil {
				done <- result{code: -1}
				return
			}
			defer resp.Body.Close()
			got, _ := io.ReadAll(resp.Body)
			done <- result{resp.StatusCode, got}
		}()
		time.Sleep(2 * time.Second) // its sandbox started, its restore under way
		select {
		case r := <-done:
			t.Fatalf("%s: done (%d) before the others could be tried: the restore was too quick to tell", what, r.code)
		default:
		}
		theirs := d.create(t, other, map[string]any{"timeout": 60})
		d.kill(t, other, theirs.SandboxID)
		var v types.VolumeAndToken
		d.expect(t, http.StatusCreated, call{method: "POST", path: "/volumes", key: other, body: map[string]any{"name": "v-" + what}}).decode(t, &v)
		select {
		case r := <-done:
			t.Errorf("%s (%d) ended before another key's create and volume did: they waited for its restore", what, r.code)
			done <- r
		default:
		}
		r := <-done
		if r.code != http.StatusCreated {
			t.Fatalf("%s: %d %s, want 201", what, r.code, r.body)
		}
		t.Logf("%s: %v, another key's create and volume meanwhile", what, time.Since(started))
		return r.body
	}

	d.expect(t, http.StatusNoContent, call{method: "POST", path: path + "/pause", key: d.key, body: map[string]any{"memory": false}})
	slow("resume", "POST", "/v2"+path+"/connect", map[string]any{"timeout": 600})
	ac = d.agent(id, sb.EnvdAccessToken)
	if out := mustRun(t, ac, `ls "/home/user/deep/$(printf 'a/%.0s' $(seq 700))" | wc -l`); out != "150\n" {
		t.Errorf("after the resume: %q files at the bottom, want 150", out)
	}
	ac.Close()
	var forks []types.SandboxForkResult
	if err := json.Unmarshal(slow("fork", "POST", path+"/fork", map[string]any{"count": 1, "timeout": 60}), &forks); err != nil || len(forks) != 1 {
		t.Fatalf("fork: %+v %v", forks, err)
	}
	d.remember(forks[0].Sandbox.SandboxID, d.key)
}
