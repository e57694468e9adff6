package store

import (
	"encoding/base64"
	"errors"
	"strings"
	"testing"
	"time"
)

// walk pages through ListSandboxes with f and returns the ids in order,
// failing on a repeated id or a cursor that does not end.
func walk(t *testing.T, s *Store, f ListFilter) []string {
	t.Helper()
	var ids []string
	seen := map[string]bool{}
	for pages := 0; ; pages++ {
		if pages > 1000 {
			t.Fatal("pagination does not end")
		}
		items, next, err := s.ListSandboxes(f)
		if err != nil {
			t.Fatal(err)
		}
		if f.Limit > 0 && len(items) > f.Limit {
			t.Fatalf("page of %d items, limit %d", len(items), f.Limit)
		}
		for _, sb := range items {
			if seen[sb.ID] {
				t.Fatalf("%s listed twice", sb.ID)
			}
			seen[sb.ID] = true
			ids = append(ids, sb.ID)
		}
		if next == "" {
			return ids
		}
		if len(items) == 0 {
			t.Fatal("empty page with a next cursor")
		}
		f.Cursor = next
	}
}

func ids(items []*Sandbox) string {
	var out []string
	for _, sb := range items {
		out = append(out, sb.ID)
	}
	return strings.Join(out, ",")
}

func TestListFilters(t *testing.T) {
	s := openTest(t, t.TempDir())
	add := func(id, key, state string, started int64, md map[string]string) {
		t.Helper()
		sb := sample(id)
		sb.KeyID, sb.State, sb.StartedAt, sb.Metadata = key, state, ts(started), md
		if err := s.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	add("a", "k1", StateRunning, 1, map[string]string{"env": "prod", "q": "a=b&c=d", "team": "x"})
	add("b", "k1", StatePaused, 2, map[string]string{"env": "prod", "q": "a=b", "team": "x"})
	add("c", "k2", StateRunning, 3, map[string]string{"env": "dev", "q": "a=b&c=d"})
	add("d", "", StateKilled, 4, nil)
	add("e", "k2", StateRunning, 0, map[string]string{"we.ird\"key": "v=1&w=2", "env": "prod", "ünï": "cödé"})

	cases := []struct {
		name string
		f    ListFilter
		want string
	}{
		{"all", ListFilter{}, "e,a,b,c,d"},
		{"key", ListFilter{KeyID: "k1"}, "a,b"},
		{"unknown key", ListFilter{KeyID: "k9"}, ""},
		{"one state", ListFilter{States: []string{StateRunning}}, "e,a,c"},
		{"two states", ListFilter{States: []string{StatePaused, StateKilled}}, "b,d"},
		{"key and state", ListFilter{KeyID: "k2", States: []string{StateRunning}}, "e,c"},
		{"metadata one", ListFilter{Metadata: map[string]string{"env": "prod"}}, "e,a,b"},
		{"metadata several", ListFilter{Metadata: map[string]string{"env": "prod", "team": "x", "q": "a=b&c=d"}}, "a"},
		{"metadata & and =", ListFilter{Metadata: map[string]string{"q": "a=b&c=d"}}, "a,c"},
		{"metadata prefix is no match", ListFilter{Metadata: map[string]string{"q": "a="}}, ""},
		{"metadata odd key", ListFilter{Metadata: map[string]string{"we.ird\"key": "v=1&w=2"}}, "e"},
		{"metadata unicode", ListFilter{Metadata: map[string]string{"ünï": "cödé"}}, "e"},
		{"metadata missing key", ListFilter{Metadata: map[string]string{"nokey": ""}}, ""},
		{"metadata empty value", ListFilter{Metadata: map[string]string{"env": ""}}, ""},
		{"metadata case", ListFilter{Metadata: map[string]string{"ENV": "prod"}}, ""},
		{"everything", ListFilter{KeyID: "k1", States: []string{StateRunning}, Metadata: map[string]string{"env": "prod"}}, "a"},
	}
	for _, c := range cases {
		items, next, err := s.ListSandboxes(c.f)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if got := ids(items); got != c.want || next != "" {
			t.Errorf("%s: got %q next %q, want %q", c.name, got, next, c.want)
		}
	}
	if _, _, err := s.ListSandboxes(ListFilter{Limit: -1}); err == nil {
		t.Error("negative limit accepted")
	}
}

func TestListPagination(t *testing.T) {
	s := openTest(t, t.TempDir())
	// Five sandboxes, "b2" and "b1" sharing a StartedAt (inserted out of order).
	for _, x := range []struct {
		id string
		at int64
	}{{"c", 3}, {"b2", 2}, {"a", 1}, {"b1", 2}, {"d", 4}} {
		sb := sample(x.id)
		sb.StartedAt = ts(x.at)
		if err := s.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	want := "a,b1,b2,c,d"

	var pages []string
	f := ListFilter{Limit: 2}
	for {
		items, next, err := s.ListSandboxes(f)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, ids(items))
		if next == "" {
			break
		}
		f.Cursor = next
	}
	if got := strings.Join(pages, "|"); got != "a,b1|b2,c|d" {
		t.Errorf("pages %q", got)
	}
	for limit := 1; limit <= 6; limit++ {
		if got := strings.Join(walk(t, s, ListFilter{Limit: limit}), ","); got != want {
			t.Errorf("limit %d: %q", limit, got)
		}
	}
	// A page that ends exactly at the last row has no next cursor.
	items, next, err := s.ListSandboxes(ListFilter{Limit: 5})
	if err != nil || len(items) != 5 || next != "" {
		t.Errorf("limit 5: %d items, next %q, %v", len(items), next, err)
	}

	// Rows added or deleted between pages cause neither repeats nor gaps
	// among the rows that stay.
	items, next, _ = s.ListSandboxes(ListFilter{Limit: 2}) // a, b1
	if err := s.DeleteSandbox("b1"); err != nil {
		t.Fatal(err)
	}
	early := sample("b0") // ties with the cursor's b1 but sorts before it: not seen, by design
	early.StartedAt = ts(2)
	late := sample("b3") // ties with b1 and b2, sorts after them
	late.StartedAt = ts(2)
	for _, sb := range []*Sandbox{early, late} {
		if err := s.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	rest := walk(t, s, ListFilter{Limit: 2, Cursor: next})
	if got := ids(items) + "|" + strings.Join(rest, ","); got != "a,b1|b2,b3,c,d" {
		t.Errorf("after changes: %q", got)
	}
}

func TestListCursorGarbage(t *testing.T) {
	s := openTest(t, t.TempDir())
	if err := s.InsertSandbox(sample("a")); err != nil {
		t.Fatal(err)
	}
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	for _, c := range []string{
		"garbage", "!!!", "====", "%00", "\x00\xff", strings.Repeat("A", 10000),
		enc("v1"), enc("v1."), enc("v1.."), enc("v1.x.a"), enc("v1.1."),
		enc("v1.1.A"), enc("v1.1.a.b"), enc("v2.1.a"), enc("v1.99999999999999999999.a"),
		enc("v1.1.a'; DROP TABLE sandboxes; --"),
	} {
		items, next, err := s.ListSandboxes(ListFilter{Cursor: c})
		if !errors.Is(err, ErrInvalidCursor) {
			t.Errorf("cursor %q: items %v next %q err %v, want ErrInvalidCursor", c, items, next, err)
		}
	}
	if all, err := s.AllSandboxes(); err != nil || len(all) != 1 {
		t.Errorf("table damaged: %v %v", all, err)
	}
	// A well-formed cursor past the end is just an empty page.
	items, next, err := s.ListSandboxes(ListFilter{Cursor: encodeCursor(1<<62, "zzz")})
	if err != nil || len(items) != 0 || next != "" {
		t.Errorf("past the end: %v %q %v", items, next, err)
	}
}

// TestListOrderTemplateStartedAfter holds E2B's newer list options: newest
// first, template, started at or after, alone and together with the other
// filters and with pages.
func TestListOrderTemplateStartedAfter(t *testing.T) {
	s := openTest(t, t.TempDir())
	add := func(id, tmpl, state string, started int64) {
		t.Helper()
		sb := sample(id)
		sb.TemplateID, sb.State, sb.StartedAt = tmpl, state, ts(started)
		if err := s.InsertSandbox(sb); err != nil {
			t.Fatal(err)
		}
	}
	add("a", "base", StateRunning, 1)
	add("b2", "host", StateRunning, 2)
	add("b1", "base", StatePaused, 2)
	add("c", "base", StateRunning, 3)
	add("d", "team/snap:default", StateRunning, 4)

	cases := []struct {
		name string
		f    ListFilter
		want string
	}{
		{"desc", ListFilter{Desc: true}, "d,c,b2,b1,a"},
		{"template", ListFilter{Template: "base"}, "a,b1,c"},
		{"template desc", ListFilter{Template: "base", Desc: true}, "c,b1,a"},
		{"template with slash and colon", ListFilter{Template: "team/snap:default"}, "d"},
		{"unknown template", ListFilter{Template: "nope"}, ""},
		{"template is exact", ListFilter{Template: "bas"}, ""},
		{"started after is inclusive", ListFilter{StartedAfter: ts(2)}, "b1,b2,c,d"},
		{"started after, a nanosecond later", ListFilter{StartedAfter: ts(2).Add(time.Nanosecond)}, "c,d"},
		{"started after the last", ListFilter{StartedAfter: ts(5)}, ""},
		{"started after long ago", ListFilter{StartedAfter: time.Date(1, 1, 1, 0, 0, 1, 0, time.UTC)}, "a,b1,b2,c,d"},
		{"started after far ahead", ListFilter{StartedAfter: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)}, ""},
		{"all together", ListFilter{Template: "base", StartedAfter: ts(2), States: []string{StateRunning}, Desc: true}, "c"},
		{"with metadata", ListFilter{Template: "base", Metadata: map[string]string{"user": "alice"}, StartedAfter: ts(2)}, "b1,c"},
	}
	for _, c := range cases {
		got := strings.Join(walk(t, s, c.f), ",")
		if got != c.want {
			t.Errorf("%s: got %q, want %q", c.name, got, c.want)
		}
		for limit := 1; limit <= 3; limit++ {
			f := c.f
			f.Limit = limit
			if paged := strings.Join(walk(t, s, f), ","); paged != c.want {
				t.Errorf("%s, limit %d: got %q, want %q", c.name, limit, paged, c.want)
			}
		}
	}
}

// A list reads no sandbox's environment (up to 64 KiB each, which no list
// shows: a page of 100 held it all) and no token; a get reads both.
func TestListHoldsNoEnvOrTokens(t *testing.T) {
	s := openTest(t, t.TempDir())
	sb := &Sandbox{ID: "a1", KeyID: "k", State: StateRunning, StartedAt: time.Unix(1, 0), EndAt: time.Unix(2, 0),
		Metadata: map[string]string{"m": "1"}, EnvVars: map[string]string{"SECRET": "x"}, AccessToken: "at", TrafficToken: "tt", NetSlot: -1}
	if err := s.InsertSandbox(sb); err != nil {
		t.Fatal(err)
	}
	items, _, err := s.ListSandboxes(ListFilter{KeyID: "k"})
	if err != nil || len(items) != 1 {
		t.Fatalf("list: %v %v", items, err)
	}
	if got := items[0]; len(got.EnvVars) != 0 || got.AccessToken != "" || got.TrafficToken != "" || got.Metadata["m"] != "1" {
		t.Errorf("listed %+v: want no environment or tokens, and the metadata", got)
	}
	if got, err := s.GetSandbox("a1"); err != nil || got.EnvVars["SECRET"] != "x" || got.AccessToken != "at" || got.TrafficToken != "tt" {
		t.Errorf("get: %+v %v", got, err)
	}
}
