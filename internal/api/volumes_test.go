package api

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/volume"
	"golang.org/x/sys/unix"
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

// TestVolumeContentRateBeforeMount: a volume's token holder sends content
// requests past its owner's rate (0.01 a second: a burst of one), to a
// volume the host has not mounted (the daemon restarted, say). Expected:
// the request past the rate is a 429 and the volume is still not mounted
// on the host; a wrong token is a 401 and mounts nothing either; the
// request within the rate mounts it and is served. Found by review,
// 2026-12-05: the volume was opened, and mounted, before the owner's
// rate was checked, so each refused request did the host's mount work.
func TestVolumeContentRateBeforeMount(t *testing.T) {
	testutil.RequireRoot(t)
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	run := t.TempDir()
	vm := volume.New(volume.Config{Data: t.TempDir(), RunDir: run, Size: 16 << 20})
	m := manager.New(manager.Config{Store: st, Volumes: vm})
	h := Handler(Config{Store: st, Manager: m, Rates: Rates{Requests: 0.01, Creates: 1}})
	_, key, err := st.CreateKey("k")
	if err != nil {
		t.Fatal(err)
	}
	v, err := m.CreateVolume(key.ID, "v")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.DeleteVolume(key.ID, v.ID); err != nil {
			t.Errorf("delete volume: %v", err)
		}
	})
	mounted := func() bool {
		var stx unix.Statx_t
		err := unix.Statx(unix.AT_FDCWD, filepath.Join(run, "volumes", v.ID), unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx)
		return err == nil && stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
	}
	list := func(token string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		r := httptest.NewRequest("GET", "/volumecontent/"+v.ID+"/dir?path=/", nil)
		r.Header.Set("Authorization", "Bearer "+token)
		h.ServeHTTP(w, r)
		return w
	}
	vm.Close() // the host's mounts detached, as by a daemon's stop
	if mounted() {
		t.Fatal("the volume is still mounted after Close")
	}
	if w := list("not-the-token"); w.Code != http.StatusUnauthorized || mounted() {
		t.Errorf("a wrong token: %d %s, mounted %v; want 401, nothing mounted", w.Code, w.Body.String(), mounted())
	}
	if w := list(v.Token); w.Code != http.StatusOK || !mounted() {
		t.Fatalf("the request within the rate: %d %s, mounted %v; want 200, mounted", w.Code, w.Body.String(), mounted())
	}
	vm.Close()
	w := list(v.Token)
	if w.Code != http.StatusTooManyRequests || !strings.Contains(w.Body.String(), `"code":"rate_limited"`) {
		t.Fatalf("the request past the rate: %d %s, want 429 rate_limited", w.Code, w.Body.String())
	}
	if mounted() {
		t.Error("the request past its owner's rate mounted the volume on the host")
	}
}
