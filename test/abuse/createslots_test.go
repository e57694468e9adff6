package abuse

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestQuotaBeforeCreateSlots: a team at its quota sends a burst of creates
// at a daemon with one create slot (limits.creating 1, so 8 waiting
// places). Every one of them is refused naming the quota (429 without
// Retry-After), none with the server's "creates are in progress" (429 with
// Retry-After), which is what a create got when it took a slot or a
// waiting place before its quota was checked; and another tenant's create
// made during the burst is served. Found by review, 2026-12-03.
func TestQuotaBeforeCreateSlots(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(cfg, []byte(`{"limits": {"creating": 1}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := cageserve.Start(t, "--config", cfg)
	newTeam(t, d, "full", "--sandboxes", "1")
	k := d.NewKeyIn(t, "k", "full")
	body := map[string]any{"templateID": "host", "timeout": 300}
	d.Create(t, k, body) // the team's one place

	n := scale(60)
	type answer struct {
		status int
		retry  string
		body   string
	}
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			st, retry, out := call(t, d, "POST", "/v2/sandboxes", k, body)
			answers[i] = answer{st, retry, out}
		}()
	}
	var other types.Sandbox
	var otherStatus int
	var otherMsg string
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-start
		other, otherStatus, otherMsg = d.TryCreate(d.Key, body)
	}()
	close(start)
	wg.Wait()
	limited := 0
	for _, a := range answers {
		var e types.Error
		_ = json.Unmarshal([]byte(a.body), &e)
		switch {
		case a.status == http.StatusTooManyRequests && strings.Contains(e.Message, "creates are in progress"):
			limited++
		default:
			refusedByQuota(t, "a create of a team at its quota", a.status, a.retry, a.body, `team "full"'s quota of 1 concurrent sandboxes`)
		}
	}
	if limited > 0 {
		t.Errorf("%d of %d creates of a team at its quota took a create slot or a waiting place (refused as the server's limit, not the quota)", limited, n)
	}
	if otherStatus != http.StatusCreated {
		t.Errorf("another tenant's create during the burst: %d %s", otherStatus, otherMsg)
	} else {
		d.Kill(d.Key, other.SandboxID)
	}
}
