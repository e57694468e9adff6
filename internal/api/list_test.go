package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// TestListFilter holds how E2B's list query becomes the store's filter:
// newest first unless asked otherwise, the SDK's comma-separated states and
// repeated ones, template and startedAfter as sent by e2b 2.46 and 2.51, and
// a one-line 400 for each malformed value.
func TestListFilter(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 15, 50, 52, 123000000, time.UTC)
	good := []struct {
		query    string
		desc     bool
		states   []string
		template string
		after    time.Time
	}{
		{"", true, nil, "", time.Time{}},
		{"order=desc", true, nil, "", time.Time{}},
		{"order=asc", false, nil, "", time.Time{}},
		{"state=running%2Cpaused", true, []string{"running", "paused"}, "", time.Time{}},
		{"state=running&state=paused", true, []string{"running", "paused"}, "", time.Time{}},
		{"template=base&order=asc", false, nil, "base", time.Time{}},
		{"template=team%2Fsnap%3Adefault", true, nil, "team/snap:default", time.Time{}},
		{"startedAfter=2026-12-01T15%3A50%3A52.123Z", true, nil, "", t0},
		{"startedAfter=2026-12-01T16:50:52.123%2B01:00", true, nil, "", t0},
		{"startedAfter=2026-12-01T15:50:52.123Z&template=host&state=running&order=asc&limit=5", false, []string{"running"}, "host", t0},
	}
	for _, c := range good {
		f, err := listFilter(httptest.NewRequest("GET", "/v2/sandboxes?"+c.query, nil))
		if err != nil {
			t.Errorf("%q: %v", c.query, err)
			continue
		}
		if f.Desc != c.desc || !slices.Equal(f.States, c.states) || f.Template != c.template || !f.StartedAfter.Equal(c.after) {
			t.Errorf("%q: desc %v states %v template %q after %v; want %v %v %q %v",
				c.query, f.Desc, f.States, f.Template, f.StartedAfter, c.desc, c.states, c.template, c.after)
		}
	}
	for _, q := range []string{
		"order=newest", "order=ASC", "startedAfter=yesterday", "startedAfter=1733068252",
		"startedAfter=2026-12-01", "state=running,stopped", "state=", "limit=0", "limit=101", "limit=x",
	} {
		if _, err := listFilter(httptest.NewRequest("GET", "/v2/sandboxes?"+q, nil)); !errors.Is(err, errBadRequest) {
			t.Errorf("%q: %v, want a bad request", q, err)
		}
	}
}

// Attack: a key lists its sandboxes with a metadata filter of hundreds
// of keys (each a subquery the store compiles for the request: 900 keys,
// 7 KB of URL, cost 65 ms of the daemon's CPU, and past 998 the request
// was a 500 and a line of the daemon's log). Expected: at most
// maxMetadataFilter keys; more is a one-line 400 naming the bound.
func TestListMetadataFilterBounded(t *testing.T) {
	filter := func(n int) string {
		v := url.Values{}
		for i := range n {
			v.Set(fmt.Sprint("k", i), "v")
		}
		return "/v2/sandboxes?metadata=" + url.QueryEscape(v.Encode())
	}
	f, err := listFilter(httptest.NewRequest("GET", filter(maxMetadataFilter), nil))
	if err != nil || len(f.Metadata) != maxMetadataFilter {
		t.Fatalf("%d keys: %v, %d in the filter", maxMetadataFilter, err, len(f.Metadata))
	}
	for _, n := range []int{maxMetadataFilter + 1, 900, 1000} {
		_, err := listFilter(httptest.NewRequest("GET", filter(n), nil))
		if !errors.Is(err, errBadRequest) || !strings.Contains(err.Error(), fmt.Sprintf("at most %d", maxMetadataFilter)) {
			t.Errorf("%d keys: %v, want a bad request naming the bound", n, err)
		}
	}
}

// heldAtWrites measures the heap the handler holds each time it writes,
// and counts the sandboxes written, keeping none of the answer.
type heldAtWrites struct {
	http.ResponseWriter
	base     uint64
	held     int64
	bytes    int64
	listed   int
	lastByte byte
}

func (w *heldAtWrites) Write(b []byte) (int, error) {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	w.held = max(w.held, int64(ms.HeapAlloc)-int64(w.base))
	w.bytes += int64(len(b))
	w.listed += strings.Count(string(b), `"sandboxID":"`)
	if len(b) > 0 {
		w.lastByte = b[len(b)-1]
	}
	return len(b), nil
}

// Attack: a key holds 300 running sandboxes (no quota bounds a key
// without a team but max_sandboxes), each with the most metadata a
// sandbox may have, 64 KiB of '<' (six bytes each as JSON), and lists
// them with the older SDKs' list, which has no pages. Expected: the
// answer is written a page at a time; the daemon never holds it whole
// (it held 280 MiB, some 1 MiB per sandbox of the key, before: found by
// review, 2026-12-04). The answer is the same bytes as before.
func TestListAnswerNotHeldWhole(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	plain, k, err := st.CreateKey("a")
	if err != nil {
		t.Fatal(err)
	}
	md := map[string]string{}
	for i := range 4 {
		md[fmt.Sprint("k", i)] = strings.Repeat("<", 16<<10-8)
	}
	const n = 300
	for i := range n {
		rec := &store.Sandbox{ID: fmt.Sprintf("%020x", i), KeyID: k.Owner(), State: store.StateRunning, Metadata: md, EnvVars: md,
			StartedAt: time.Unix(int64(1e9+i), 0), EndAt: time.Now().Add(time.Hour), NetSlot: -1}
		if err := st.InsertSandbox(rec); err != nil {
			t.Fatal(err)
		}
	}
	h := Handler(Config{Store: st, Manager: manager.New(manager.Config{Store: st})})
	r := httptest.NewRequest("GET", "/sandboxes", nil)
	r.Header.Set("X-API-Key", plain)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	rec := httptest.NewRecorder()
	w := &heldAtWrites{ResponseWriter: rec, base: ms.HeapAlloc}
	h.ServeHTTP(w, r)
	if rec.Code != http.StatusOK || w.listed != n || w.lastByte != '\n' {
		t.Fatalf("status %d, %d sandboxes listed, last byte %q; want 200, %d, a whole answer", rec.Code, w.listed, w.lastByte, n)
	}
	if w.held > 64<<20 {
		t.Errorf("the daemon held %d MiB to write a list of %d MiB", w.held>>20, w.bytes>>20)
	}
	t.Logf("held %d MiB to write %d MiB", w.held>>20, w.bytes>>20)

	// A few sandboxes: the same bytes as the whole answer written at once.
	for i := 3; i < n; i++ {
		if err := st.DeleteSandbox(fmt.Sprintf("%020x", i)); err != nil {
			t.Fatal(err)
		}
	}
	small := map[string]string{"a": "<b>"}
	for i := range 3 {
		id := fmt.Sprintf("%020x", i)
		sb, err := st.GetSandbox(id)
		if err != nil {
			t.Fatal(err)
		}
		sb.Metadata = small
		if err := st.UpdateSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	for _, path := range []string{"/sandboxes", "/v2/sandboxes?limit=2", "/sandboxes?metadata=a%3Dnone"} {
		r := httptest.NewRequest("GET", path, nil)
		r.Header.Set("X-API-Key", plain)
		got := httptest.NewRecorder()
		h.ServeHTTP(got, r)
		f, _ := listFilter(r)
		if path == "/sandboxes" || strings.Contains(path, "metadata") {
			f.Limit, f.States = 0, []string{store.StateRunning}
		}
		f.KeyID = k.Owner()
		items, _, err := st.ListSandboxes(f)
		if err != nil {
			t.Fatal(err)
		}
		out := make([]types.ListedSandbox, 0, len(items))
		for _, sb := range items {
			out = append(out, listedOf(sb))
		}
		want := httptest.NewRecorder()
		writeJSON(want, http.StatusOK, out)
		if got.Code != http.StatusOK || got.Body.String() != want.Body.String() || got.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s: %d %q\nwant %q", path, got.Code, got.Body.String(), want.Body.String())
		}
	}
}
