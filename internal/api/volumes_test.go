package api

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/volume"
)

// Attack: whoever holds a volume's token lists it (up to 16 MiB of
// names a listing) and reads none of the answers, on as many connections
// as its address may open, each holding its listing. Expected: at most
// maxListsInFlight listings of one owner's volumes at once, 429 in the
// content API's shape with Retry-After beyond, while other owners'
// volumes, the volume's other routes and the owner's API lists are
// served; listings go on once those end, the same answer as before.
func TestVolumeListingsInFlightBounded(t *testing.T) {
	testutil.RequireRoot(t)
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() }) // after the volumes' removal (cleanups run last first)
	vm := volume.New(volume.Config{Data: t.TempDir(), RunDir: t.TempDir(), Size: 16 << 20})
	h := Handler(Config{Store: st, Manager: manager.New(manager.Config{Store: st, Volumes: vm})})
	do := func(method, path, key, token string, w http.ResponseWriter) {
		r := httptest.NewRequest(method, path, strings.NewReader(`{"name":"v"}`))
		if key != "" {
			r.Header.Set("X-API-Key", key)
		}
		if token != "" {
			r.Header.Set("Authorization", "Bearer "+token)
		}
		h.ServeHTTP(w, r)
	}
	type vol struct{ key, id, token string }
	var vols []vol
	for range 2 {
		key, _, err := st.CreateKey("k")
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		do("POST", "/volumes", key, "", w)
		var v types.VolumeAndToken
		if w.Code != http.StatusCreated || json.Unmarshal(w.Body.Bytes(), &v) != nil {
			t.Fatalf("create a volume: %d %s", w.Code, w.Body.String())
		}
		vols = append(vols, vol{key, v.VolumeID, v.Token})
		t.Cleanup(func() {
			w := httptest.NewRecorder()
			do("DELETE", "/volumes/"+v.VolumeID, key, "", w)
			if w.Code != http.StatusNoContent {
				t.Errorf("delete volume %s: %d %s", v.VolumeID, w.Code, w.Body.String())
			}
		})
	}
	a, b := vols[0], vols[1]
	for _, d := range []string{"/x", "/y"} {
		w := httptest.NewRecorder()
		do("POST", "/volumecontent/"+a.id+"/dir?path="+d, "", a.token, w)
		if w.Code != http.StatusCreated {
			t.Fatalf("make %s: %d %s", d, w.Code, w.Body.String())
		}
	}
	list := "/volumecontent/" + a.id + "/dir?path=/"
	before := httptest.NewRecorder()
	do("GET", list, "", a.token, before)
	var entries []types.VolumeEntryStat
	if before.Code != http.StatusOK || json.Unmarshal(before.Body.Bytes(), &entries) != nil || len(entries) != 2 {
		t.Fatalf("listing: %d %s", before.Code, before.Body.String())
	}
	want := httptest.NewRecorder()
	writeJSON(want, http.StatusOK, entries)
	if before.Body.String() != want.Body.String() {
		t.Errorf("listing %q, want %q", before.Body.String(), want.Body.String())
	}

	writing, release := make(chan struct{}), make(chan struct{})
	var held sync.WaitGroup
	for range maxListsInFlight {
		held.Add(1)
		go func() {
			defer held.Done()
			do("GET", list, "", a.token, &blockedWriter{ResponseWriter: httptest.NewRecorder(), writing: writing, release: release})
		}()
		<-writing
	}
	w := httptest.NewRecorder()
	do("GET", list, "", a.token, w)
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" || !strings.Contains(w.Body.String(), `"code":"rate_limited"`) {
		t.Errorf("a listing past %d in flight: %d %s (Retry-After %q), want 429 rate_limited", maxListsInFlight, w.Code, w.Body.String(), w.Header().Get("Retry-After"))
	}
	for _, c := range []struct{ path, key, token string }{
		{"/volumecontent/" + b.id + "/dir?path=/", "", b.token},   // another owner's volume
		{"/volumecontent/" + a.id + "/path?path=/x", "", a.token}, // another route of the volume
		{"/v2/sandboxes", a.key, ""},                              // the owner's API lists
	} {
		w := httptest.NewRecorder()
		do("GET", c.path, c.key, c.token, w)
		if w.Code != http.StatusOK {
			t.Errorf("%s: %d %s, want 200", c.path, w.Code, w.Body.String())
		}
	}
	close(release)
	held.Wait()
	after := httptest.NewRecorder()
	do("GET", list, "", a.token, after)
	if after.Code != http.StatusOK || after.Body.String() != before.Body.String() {
		t.Errorf("listing once the others ended: %d %s", after.Code, after.Body.String())
	}
}
