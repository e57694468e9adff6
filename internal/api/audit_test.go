package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// Attack: a key's sandboxes start 1,000 processes, each with 16 KiB of
// control characters as its argv (the most an entry keeps of it, six
// bytes each as JSON), and the key reads them back in one page of GET
// /audit (at most 1,000 entries). Expected: the page is read and written
// a few entries at a time; the daemon never holds it whole (172 MiB
// before, for each such request: found by review, 2026-12-04). Pages
// are the same bytes as before, cursors and all.
func TestAuditPageNotHeldWhole(t *testing.T) {
	dir := t.TempDir()
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	plain, k, err := st.CreateKey("a")
	if err != nil {
		t.Fatal(err)
	}
	_, other, err := st.CreateKey("b")
	if err != nil {
		t.Fatal(err)
	}
	db, err := audit.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	var evs []audit.Event
	for i := range 1000 {
		evs = append(evs, audit.Event{Kind: audit.KindProcessStart, KeyID: k.ID, SandboxID: fmt.Sprintf("%020x", i%3),
			Detail: map[string]any{"argv": []string{strings.Repeat("\x01", 16<<10)}}})
		if i%100 == 0 { // another key's, in between
			evs = append(evs, audit.Event{Kind: audit.KindProcessStart, KeyID: other.ID, SandboxID: fmt.Sprintf("%020x", i%3)})
		}
	}
	if err := db.Append(evs...); err != nil {
		t.Fatal(err)
	}
	tr := audit.Start(db, audit.Limits{}, nil)
	defer tr.Close()
	h := Handler(Config{Store: st, Manager: manager.New(manager.Config{Store: st}), Audit: tr})
	r := httptest.NewRequest("GET", "/audit?limit=1000&kind=process", nil)
	r.Header.Set("X-API-Key", plain)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	rec := httptest.NewRecorder()
	w := &heldAtWrites{ResponseWriter: rec, base: ms.HeapAlloc}
	h.ServeHTTP(w, r)
	if rec.Code != http.StatusOK || w.lastByte != '\n' || w.bytes < 90<<20 {
		t.Fatalf("status %d, %d bytes, last byte %q; want 200 and the whole page", rec.Code, w.bytes, w.lastByte)
	}
	if w.held > 48<<20 {
		t.Errorf("the daemon held %d MiB to write a page of %d MiB", w.held>>20, w.bytes>>20)
	}
	t.Logf("held %d MiB to write %d MiB", w.held>>20, w.bytes>>20)

	// Pages, as they were written whole.
	want := func(q string) string {
		r := httptest.NewRequest("GET", "/audit?"+q, nil)
		f, err := auditFilter(r)
		if err != nil {
			t.Fatal(err)
		}
		f.KeyID, f.TeamID = k.ID, ""
		limit := f.Limit
		f.Limit++
		es, err := db.Query(f)
		if err != nil {
			t.Fatal(err)
		}
		page := types.AuditPage{Entries: []types.AuditEntry{}}
		if len(es) > limit {
			es = es[:limit]
			page.NextToken = strconv.FormatInt(es[limit-1].Seq, 10)
		}
		for _, e := range es {
			page.Entries = append(page.Entries, EntryJSON(e))
		}
		w := httptest.NewRecorder()
		writeJSON(w, http.StatusOK, page)
		return w.Body.String()
	}
	next := ""
	for _, q := range []string{"limit=3", "limit=40&sandboxID=00000000000000000001", "limit=33&kind=process.start",
		"limit=32", "limit=1000&kind=sandbox", "limit=31&nextToken=", "limit=1"} {
		if strings.HasSuffix(q, "nextToken=") {
			q += next
		}
		r := httptest.NewRequest("GET", "/audit?"+q, nil)
		r.Header.Set("X-API-Key", plain)
		got := httptest.NewRecorder()
		h.ServeHTTP(got, r)
		if w := want(q); got.Code != http.StatusOK || got.Body.String() != w {
			t.Errorf("%s: %d %.300q\nwant %.300q", q, got.Code, got.Body.String(), w)
		}
		if n := got.Header().Get("X-Next-Token"); n != "" {
			next = n
		} else if !strings.Contains(q, "kind=sandbox") {
			t.Errorf("%s: no X-Next-Token", q)
		}
	}
}

// Attack: a key reads its audit entries naming hundreds of kinds (each a
// term of the statement the trail compiles for the request: 900 cost 49
// ms of the daemon's CPU, past 1,000 the request was a 500). Expected:
// at most maxAuditKinds distinct kinds and families, a kind named twice
// counted once; more is a one-line 400 naming the bound.
func TestAuditKindsBounded(t *testing.T) {
	kinds := func(n int) string {
		var ks []string
		for i := range n {
			ks = append(ks, fmt.Sprint("k", i))
		}
		return strings.Join(ks, ",")
	}
	for _, q := range []string{kinds(maxAuditKinds), strings.Repeat("process,", 5000) + "sandbox.create"} {
		if _, err := auditFilter(httptest.NewRequest("GET", "/audit?kind="+q, nil)); err != nil {
			t.Errorf("kind=%.40s...: %v", q, err)
		}
	}
	for _, n := range []int{maxAuditKinds + 1, 900, 1100} {
		_, err := auditFilter(httptest.NewRequest("GET", "/audit?kind="+kinds(n), nil))
		if !errors.Is(err, errBadRequest) || !strings.Contains(err.Error(), fmt.Sprintf("at most %d", maxAuditKinds)) {
			t.Errorf("%d kinds: %v, want a bad request naming the bound", n, err)
		}
	}
}
