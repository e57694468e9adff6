package abuse

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestMCPTakesTheKeysRate: a request to /mcp is one of its key's requests,
// as an API call is: past the key's rate, 429 with Retry-After before the
// body is read, and another team's key is not held by it. Found by
// review, 2026-12-03: /mcp took nothing of the key's rate, so a key sent
// requests without bound (16 at a time), each a millisecond of the
// daemon's CPU where its Host named another proxy address.
func TestMCPTakesTheKeysRate(t *testing.T) {
	d := cageserve.Start(t)
	newTeam(t, d, "slow", "--requests", "1")
	newTeam(t, d, "other")
	slow, other := d.NewKeyIn(t, "s1", "slow"), d.NewKeyIn(t, "o1", "other")
	list := `{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}`
	post := func(key, body string) (int, string, string) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+d.API+"/mcp", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := d.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
	}
	// A burst of 2, then 429. The bucket refills at 1 a second while they
	// go: on a slow host they earn more than the burst, so they go until
	// five are refused, and what is served is bounded by the time they
	// took.
	served, limited, retry := 0, 0, ""
	start := time.Now()
	for i := 0; limited < 5 && i < 200; i++ {
		st, ra, body := post(slow, list)
		switch st {
		case http.StatusOK:
			served++
		case http.StatusTooManyRequests:
			limited++
			retry = ra
			if !strings.Contains(body, "rate limit") {
				t.Errorf("429 body: %s", body)
			}
		default:
			t.Fatalf("/mcp: %d %s", st, body)
		}
	}
	took := time.Since(start)
	if most := 3 + int(took.Seconds()); served < 2 || served > most || limited < 5 || retry == "" {
		t.Errorf("requests to /mcp at 1/s for %v: %d served, %d refused (Retry-After %q); want 2 to %d served (the burst and what %v earns), then 429",
			took.Round(time.Millisecond), served, limited, retry, most, took.Round(time.Millisecond))
	}
	// Refused before its body is read: a body that is not even JSON. Not
	// on slow's key: a refusal leaves its bucket up to a token short, and
	// it refills at 1 a second, so a request sent a moment later could
	// find a token (then its body is read: 400). A key of a team at 0.01
	// a second (a burst of 1) earns none for 100 s once its token is
	// taken.
	newTeam(t, d, "glacial", "--requests", "0.01")
	glacial := d.NewKeyIn(t, "g1", "glacial")
	if st, _, body := post(glacial, list); st != http.StatusOK {
		t.Fatalf("/mcp at 0.01/s, the first request: %d %s", st, body)
	}
	if st, _, body := post(glacial, "not json"+strings.Repeat(" ", 1<<20)); st != http.StatusTooManyRequests {
		t.Errorf("a bad body over the rate: %d %s", st, body)
	}
	if st, _, body := post(other, list); st != http.StatusOK {
		t.Errorf("another team's key while slow's is limited: %d %s", st, body)
	}
}
