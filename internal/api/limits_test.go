package api

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// TestTakeN: n tokens are taken at once or not at all, and n beyond the
// burst never fits: a fork of n sandboxes costs what n creates cost (it
// cost one: found by review, 2026-12-03, 12 sandboxes for one token of a
// key allowed 0.1 creates a second).
func TestTakeN(t *testing.T) {
	var l limiter
	now := time.Unix(1_700_000_000, 0)
	const rate = 1.0 // burst 2
	if ok, _ := l.takeN("k", rate, 3, now); ok {
		t.Fatal("3 tokens from a bucket of 2")
	}
	if ok, _ := l.takeN("k", rate, 2, now); !ok {
		t.Fatal("2 tokens from a full bucket of 2")
	}
	ok, wait := l.takeN("k", rate, 2, now)
	if ok || wait != 2*time.Second {
		t.Fatalf("2 more at once: %v, wait %v (want a refusal, 2 s)", ok, wait)
	}
	if ok, _ := l.takeN("k", rate, 1, now.Add(time.Second)); !ok {
		t.Fatal("1 token a second later")
	}
	if ok, _ := l.takeN("k", rate, 2, now.Add(2*time.Second)); ok {
		t.Fatal("2 tokens when 1 came back")
	}
	if ok, _ := l.takeN("k", rate, 1, now.Add(2*time.Second)); !ok {
		t.Fatal("the 1 token a refusal of 2 must have left")
	}
}

// blockedWriter is a client that reads nothing: its answer's first write
// waits until release is closed.
type blockedWriter struct {
	http.ResponseWriter
	writing chan<- struct{}
	release <-chan struct{}
	once    sync.Once
}

func (w *blockedWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { w.writing <- struct{}{} })
	<-w.release
	return w.ResponseWriter.Write(b)
}

// Attack: a key sends list requests and reads none of their answers,
// each holding the page it is written from for as long as a write may
// wait (a page of sandboxes up to 25 MiB), on as many connections as its
// address may open. Expected: an owner (a team, or a key without one)
// has at most maxListsInFlight such lists in flight, of every kind
// together (sandboxes, audit entries, network records);
// past that, 429 with Retry-After before anything is read, while other
// owners' lists and the owner's other calls are served; once its lists
// end, it lists again.
func TestListsInFlightBounded(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	team, err := st.CreateTeam("alpha", store.TeamLimits{})
	if err != nil {
		t.Fatal(err)
	}
	keyOf := func(team string) string {
		plain, _, err := st.CreateKeyWith(store.KeyOptions{Name: "k", TeamID: team})
		if err != nil {
			t.Fatal(err)
		}
		return plain
	}
	a1, a2, other := keyOf(team.ID), keyOf(team.ID), keyOf("")
	h := Handler(Config{Store: st, Manager: manager.New(manager.Config{Store: st})})
	call := func(key, path string) *httptest.ResponseRecorder {
		r := httptest.NewRequest("GET", path, nil)
		r.Header.Set("X-API-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	writing, release := make(chan struct{}), make(chan struct{})
	var held sync.WaitGroup
	for i := range maxListsInFlight {
		held.Add(1)
		go func() {
			defer held.Done()
			path := []string{"/v2/sandboxes", "/sandboxes", "/audit"}[i%3]
			r := httptest.NewRequest("GET", path, nil)
			r.Header.Set("X-API-Key", a1)
			h.ServeHTTP(&blockedWriter{ResponseWriter: httptest.NewRecorder(), writing: writing, release: release}, r)
		}()
		<-writing
	}
	for _, key := range []string{a1, a2} {
		for _, path := range []string{"/v2/sandboxes", "/sandboxes?limit=5", "/audit", "/sandboxes/00000000000000000000/network/records"} {
			if w := call(key, path); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" {
				t.Errorf("%s with %d lists of its team in flight: %d %q (Retry-After %q), want 429",
					path, maxListsInFlight, w.Code, w.Body.String(), w.Header().Get("Retry-After"))
			}
		}
	}
	if w := call(other, "/v2/sandboxes"); w.Code != http.StatusOK {
		t.Errorf("another owner's list: %d %q, want 200", w.Code, w.Body.String())
	}
	for _, path := range []string{"/sandboxes/00000000000000000000", "/sandboxes/00000000000000000000/metrics"} {
		if w := call(a2, path); w.Code != http.StatusNotFound {
			t.Errorf("the team's %s: %d %q, want 404", path, w.Code, w.Body.String())
		}
	}
	for _, path := range []string{"/snapshots", "/volumes"} {
		if w := call(a2, path); w.Code != http.StatusOK {
			t.Errorf("the team's %s (small records): %d %q, want 200", path, w.Code, w.Body.String())
		}
	}
	close(release)
	held.Wait()
	if w := call(a2, "/v2/sandboxes"); w.Code != http.StatusOK {
		t.Errorf("the team's list once its lists ended: %d %q, want 200", w.Code, w.Body.String())
	}
}

// forwardingCluster is a cluster front whose sandboxes are all on this
// node, and for which a request carrying a node signature was forwarded
// by another node.
type forwardingCluster struct{ Cluster }

func (forwardingCluster) Forward(http.ResponseWriter, *http.Request, string, string) bool {
	return false
}
func (forwardingCluster) Forwarded(r *http.Request) bool {
	return r.Header.Get("X-Cage-Node-Auth") != ""
}

// Attack: in cluster mode, a key resumes its sandbox through a front other
// than the sandbox's node, which forwards the request before any handler
// runs (so the front takes no create token) and signs it (so the node
// took none either). Expected: the node takes the key's create tokens for
// a forwarded resume as for any: past the burst, 429 with Retry-After.
func TestForwardedResumePaysItsCreate(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	plain, _, err := st.CreateKey("a")
	if err != nil {
		t.Fatal(err)
	}
	h := Handler(Config{Store: st, Manager: manager.New(manager.Config{Store: st}), Cluster: forwardingCluster{},
		Rates: Rates{Creates: 1}})
	var codes []int
	for range 3 {
		r := httptest.NewRequest("POST", "/sandboxes/00000000000000000000/resume", nil)
		r.Header.Set("X-API-Key", plain)
		r.Header.Set("X-Cage-Node-Auth", "node=b,t=1,sig=00")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		codes = append(codes, w.Code)
		if w.Code == http.StatusTooManyRequests && w.Header().Get("Retry-After") == "" {
			t.Error("429 without Retry-After")
		}
	}
	if codes[0] != http.StatusNotFound || codes[1] != http.StatusNotFound || codes[2] != http.StatusTooManyRequests {
		t.Errorf("three forwarded resumes with a burst of 2 creates: %v, want [404 404 429]", codes)
	}
}
