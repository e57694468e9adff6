package api

import (
	"errors"
	"net/http/httptest"
	"slices"
	"testing"
	"time"
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
