package ui

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/imgstore"
)

// These tests hold the session layer to its rules without a daemon (the
// browser suite in test/ui runs a real one): the API behind it here is a
// recorder of what the UI passes on.

const goodKey = "e2b_" + "1234567890123456789012345678901234567890"

type fakeAPI struct {
	mu    sync.Mutex
	calls []*http.Request
}

func (f *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.calls = append(f.calls, r)
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `[]`)
}

func (f *fakeAPI) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newTest(t *testing.T) (*Server, *fakeAPI, *clock) {
	t.Helper()
	api := &fakeAPI{}
	s := New(Config{API: api, Proxy: "http://127.0.0.1:1", MaxUpload: 1000,
		Verify: func(key string) (Identity, error) {
			if key != goodKey {
				return Identity{}, ErrBadKey
			}
			return Identity{KeyID: "key_1", Name: "k"}, nil
		}})
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	s.now = c.now
	return s, api, c
}

func do(s *Server, method, path, body string, hdr map[string]string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, "http://cage.test"+path, strings.NewReader(body))
	for k, v := range hdr {
		r.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	s.ServeHTTP(w, r)
	return w
}

// signIn returns the session cookie and CSRF token.
func signIn(t *testing.T, s *Server) (string, string) {
	t.Helper()
	w := do(s, "POST", "/ui/session", `{"key":"`+goodKey+`"}`, map[string]string{"Content-Type": "application/json", "Origin": "http://cage.test"})
	if w.Code != 200 {
		t.Fatalf("sign in: %d %s", w.Code, w.Body)
	}
	c := w.Result().Cookies()
	if len(c) != 1 || !c[0].HttpOnly || c[0].SameSite != http.SameSiteStrictMode || c[0].Path != "/ui" || c[0].Secure {
		t.Fatalf("session cookie %+v: want HttpOnly, SameSite=Strict, Path=/ui (not Secure over plain HTTP)", c)
	}
	var sj sessionJSON
	if err := json.Unmarshal(w.Body.Bytes(), &sj); err != nil || len(sj.CSRF) != 64 {
		t.Fatalf("sign-in answer %s", w.Body)
	}
	if strings.Contains(w.Body.String(), goodKey) {
		t.Fatal("the sign-in answer holds the key")
	}
	return "cage_ui=" + c[0].Value, sj.CSRF
}

func TestSignInRefusals(t *testing.T) {
	s, _, _ := newTest(t)
	for _, c := range []struct {
		name, body string
		hdr        map[string]string
		want       int
	}{
		{"wrong key", `{"key":"e2b_nope"}`, map[string]string{"Content-Type": "application/json"}, 401},
		{"no key", `{}`, map[string]string{"Content-Type": "application/json"}, 400},
		{"a form (cross-site forms cannot send JSON)", `key=` + goodKey, map[string]string{"Content-Type": "application/x-www-form-urlencoded"}, 415},
		{"another origin", `{"key":"` + goodKey + `"}`, map[string]string{"Content-Type": "application/json", "Origin": "http://evil.test"}, 403},
		{"malformed", `{"key":`, map[string]string{"Content-Type": "application/json"}, 400},
	} {
		w := do(s, "POST", "/ui/session", c.body, c.hdr)
		if w.Code != c.want || len(w.Result().Cookies()) != 0 {
			t.Errorf("%s: %d %s (cookies %v), want %d and no cookie", c.name, w.Code, w.Body, w.Result().Cookies(), c.want)
		}
	}
}

func TestCSRFAndPassThrough(t *testing.T) {
	s, api, _ := newTest(t)
	cookie, csrf := signIn(t, s)
	for _, c := range []struct {
		name string
		hdr  map[string]string
		want int
	}{
		{"no cookie", map[string]string{"X-CSRF-Token": csrf}, 401},
		{"no token", map[string]string{"Cookie": cookie}, 403},
		{"wrong token", map[string]string{"Cookie": cookie, "X-CSRF-Token": strings.Repeat("0", 64)}, 403},
		{"another origin", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf, "Origin": "http://evil.test"}, 403},
		{"this host as a suffix", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf, "Origin": "http://cage.test.evil.test"}, 403},
		{"another port", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf, "Origin": "http://cage.test:8080"}, 403},
		{"an opaque origin", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf, "Origin": "null"}, 403},
		{"cross-site", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"}, 403},
		{"forged session id", map[string]string{"Cookie": "cage_ui=" + strings.Repeat("a", 64), "X-CSRF-Token": csrf}, 401},
	} {
		if w := do(s, "POST", "/ui/api/v2/sandboxes", `{}`, c.hdr); w.Code != c.want {
			t.Errorf("%s: %d %s, want %d", c.name, w.Code, w.Body, c.want)
		}
	}
	if api.count() != 0 {
		t.Fatalf("refused requests reached the API (%d)", api.count())
	}
	w := do(s, "POST", "/ui/api/v2/sandboxes?x=1", `{}`, map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf,
		"Origin": "https://cage.test", "Content-Type": "application/json", "Authorization": "Bearer smuggled"})
	if w.Code != 200 || api.count() != 1 {
		t.Fatalf("a proper request (Origin https://: behind a TLS proxy): %d %s, API calls %d", w.Code, w.Body, api.count())
	}
	r := api.calls[0]
	if r.URL.Path != "/v2/sandboxes" || r.URL.RawQuery != "x=1" || r.Header.Get("X-API-Key") != goodKey ||
		r.Header.Get("Cookie") != "" || r.Header.Get("Authorization") != "" || r.Header.Get("X-CSRF-Token") != "" {
		t.Errorf("the API got %s %s with headers %v: want the path, the session's key and nothing of the browser's", r.Method, r.URL, r.Header)
	}
	// A GET needs no token.
	if w := do(s, "GET", "/ui/api/v2/sandboxes", "", map[string]string{"Cookie": cookie}); w.Code != 200 {
		t.Errorf("GET with the cookie: %d", w.Code)
	}
}

func TestSessionExpiryAndSignOut(t *testing.T) {
	s, _, c := newTest(t)
	cookie, csrf := signIn(t, s)
	get := func() int { return do(s, "GET", "/ui/session", "", map[string]string{"Cookie": cookie}).Code }
	for i := 0; i < 30; i++ { // used every 29 minutes: alive past 12 h? no: the absolute age ends it
		c.add(29 * time.Minute)
		if got := get(); got != 200 && i < 24 {
			t.Fatalf("used every 29 minutes, %d: %d", i, got)
		} else if got == 401 {
			if age := time.Duration(i+1) * 29 * time.Minute; age < DefaultSessionMax {
				t.Fatalf("ended after %v, before its absolute age", age)
			}
			break
		}
	}
	if get() != 401 {
		t.Fatal("a session past its absolute age still answers")
	}
	cookie, csrf = signIn(t, s)
	c.add(DefaultSessionIdle + time.Second)
	if got := get(); got != 401 {
		t.Fatalf("idle past %v: %d, want 401", DefaultSessionIdle, got)
	}
	cookie, csrf = signIn(t, s)
	if w := do(s, "DELETE", "/ui/session", "", map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf}); w.Code != 204 {
		t.Fatalf("sign out: %d", w.Code)
	}
	if got := get(); got != 401 {
		t.Fatalf("after sign-out: %d, want 401", got)
	}
}

func TestUploadBoundedBeforeRead(t *testing.T) {
	s, api, _ := newTest(t)
	cookie, csrf := signIn(t, s)
	h := map[string]string{"Cookie": cookie, "X-CSRF-Token": csrf}
	if w := do(s, "POST", "/ui/files/sb/upload?path=/tmp/x", strings.Repeat("x", 1001), h); w.Code != 413 {
		t.Errorf("upload over MaxUpload: %d %s, want 413", w.Code, w.Body)
	}
	r := httptest.NewRequest("POST", "http://cage.test/ui/files/sb/upload?path=/tmp/x", io.NopCloser(strings.NewReader("x")))
	r.ContentLength = -1
	r.Header.Set("Cookie", cookie)
	r.Header.Set("X-CSRF-Token", csrf)
	w := httptest.NewRecorder()
	s.ServeHTTP(w, r)
	if w.Code != 411 {
		t.Errorf("upload without a length: %d, want 411", w.Code)
	}
	if api.count() != 0 {
		t.Errorf("refused uploads asked the API (%d)", api.count())
	}
}

func TestHeaders(t *testing.T) {
	s, _, _ := newTest(t)
	w := do(s, "GET", "/ui/", "", nil)
	if w.Code != 200 || !strings.Contains(w.Header().Get("Content-Security-Policy"), "script-src 'self'") ||
		w.Header().Get("X-Frame-Options") != "DENY" || strings.Contains(w.Body.String(), "<script>") {
		t.Fatalf("/ui/: %d %v", w.Code, w.Header())
	}
	for _, p := range []string{"/ui/static/js/main.js", "/ui/static/vendor/xterm.js", "/ui/static/app.css"} {
		if w := do(s, "GET", p, "", nil); w.Code != 200 {
			t.Errorf("%s: %d", p, w.Code)
		}
	}
	if w := do(s, "GET", "/ui/static/", "", nil); w.Code != 404 {
		t.Errorf("the assets' directory lists: %d", w.Code)
	}
}

// TestStreamsBounded: a session holds at most maxStreams live pages and
// terminals; one more is 429 until one ends.
func TestStreamsBounded(t *testing.T) {
	s, _, _ := newTest(t)
	srv := httptest.NewServer(s)
	defer srv.Close()
	cookie, _ := signIn(t, s)
	open := func(ctx context.Context) (*http.Response, error) {
		req, err := http.NewRequestWithContext(ctx, "GET", srv.URL+"/ui/events/sandboxes", nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Cookie", cookie)
		return http.DefaultClient.Do(req)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var first context.CancelFunc
	for i := 0; i < maxStreams; i++ {
		c, cc := context.WithCancel(ctx)
		defer cc()
		if i == 0 {
			first = cc
		}
		resp, err := open(c)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("stream %d: %v %v", i, err, resp)
		}
		defer resp.Body.Close()
	}
	resp, err := open(ctx)
	if err != nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("stream %d: %v %v, want 429", maxStreams+1, err, resp)
	}
	resp.Body.Close()
	first()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := open(ctx)
		if err == nil && resp.StatusCode == http.StatusOK {
			resp.Body.Close()
			break
		}
		if resp != nil {
			resp.Body.Close()
		}
		if time.Now().After(deadline) {
			t.Fatal("a stream that ended still counts")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A key holder who signs in in a loop ends its own oldest sessions, never
// another key's: one key keeps at most maxKeySessions.
func TestSessionsPerKeyBounded(t *testing.T) {
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	ss := newSessions(DefaultSessionIdle, DefaultSessionMax, c.now)
	other := ss.create("e2b_other", Identity{KeyID: "key_2"})
	first := ss.create(goodKey, Identity{KeyID: "key_1"})
	var last *session
	for i := 0; i < 3*maxKeySessions; i++ {
		c.add(time.Second)
		last = ss.create(goodKey, Identity{KeyID: "key_1"})
	}
	if _, ok := ss.get(other.id, false); !ok {
		t.Fatal("another key's session was ended by a key signing in in a loop")
	}
	if _, ok := ss.get(first.id, false); ok {
		t.Fatal("the looping key's oldest session outlived its bound")
	}
	if _, ok := ss.get(last.id, false); !ok {
		t.Fatal("the newest session is gone")
	}
	n := 0
	for _, x := range ss.m {
		if x.key == goodKey {
			n++
		}
	}
	if n != maxKeySessions {
		t.Fatalf("the key holds %d sessions, want %d", n, maxKeySessions)
	}
}

// TestSessionCookieOverTLS: behind TLS (here a proxy saying so) the
// session cookie is __Host-cage_ui at / (Secure, no Domain), which a
// browser takes from no other host: a sandbox's page under the same parent
// domain cannot set it. A cage_ui cookie such a page could set (cookie
// tossing: a session of its owner's choosing) is not read there.
func TestSessionCookieOverTLS(t *testing.T) {
	s, _, _ := newTest(t)
	tls := map[string]string{"Content-Type": "application/json", "Origin": "https://cage.test", "X-Forwarded-Proto": "https"}
	w := do(s, "POST", "/ui/session", `{"key":"`+goodKey+`"}`, tls)
	c := w.Result().Cookies()
	if w.Code != 200 || len(c) != 1 || c[0].Name != "__Host-cage_ui" || c[0].Path != "/" || !c[0].Secure || c[0].Domain != "" ||
		!c[0].HttpOnly || c[0].SameSite != http.SameSiteStrictMode {
		t.Fatalf("sign-in over TLS: %d, cookies %+v; want one __Host-cage_ui, Path /, Secure, HttpOnly, Strict", w.Code, c)
	}
	get := func(cookie string) int {
		return do(s, "GET", "/ui/session", "", map[string]string{"X-Forwarded-Proto": "https", "Cookie": cookie}).Code
	}
	if code := get("__Host-cage_ui=" + c[0].Value); code != 200 {
		t.Errorf("the session's own cookie: %d", code)
	}
	// The same session id, as a page of another host could set it.
	if code := get("cage_ui=" + c[0].Value); code != http.StatusUnauthorized {
		t.Errorf("a cage_ui cookie over TLS: %d, want 401 (not read)", code)
	}
}

// TestRevokedKeyEndsItsSession: a key revoked while its dashboard session
// is signed in ends the session within moments: its open streams (a
// terminal's among them) end, and its next request is refused.
func TestRevokedKeyEndsItsSession(t *testing.T) {
	defer func(d time.Duration) { keyRecheck = d }(keyRecheck)
	keyRecheck = 50 * time.Millisecond
	var revoked atomic.Bool
	s := New(Config{API: &fakeAPI{}, Proxy: "http://127.0.0.1:1",
		Verify: func(key string) (Identity, error) {
			if key != goodKey || revoked.Load() {
				return Identity{}, ErrBadKey
			}
			return Identity{KeyID: "key_1", Name: "k"}, nil
		}})
	srv := httptest.NewServer(s)
	defer srv.Close()
	cookie, csrf := signIn(t, s)
	req, _ := http.NewRequest("GET", srv.URL+"/ui/events/sandboxes", nil)
	req.Header.Set("Cookie", cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("open a stream: %v %v", err, resp)
	}
	defer resp.Body.Close()
	revoked.Store(true)
	ended := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(resp.Body); ended <- b }()
	select {
	case b := <-ended:
		// Told, not only cut: a cut stream the browser reconnects, is
		// refused with a 401 its event source hides, and the page waits.
		if !bytes.Contains(b, []byte("event: expired\n")) {
			t.Errorf("the stream ended without telling the page the session ended: %q", b)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a stream of a session whose key was revoked is still open 20 s later")
	}
	w := do(s, "POST", "/ui/term/sb1/t1/input", `{"data":"eA=="}`, map[string]string{"Cookie": cookie, csrfHeader: csrf, "Origin": "http://cage.test"})
	if w.Code != http.StatusUnauthorized {
		t.Errorf("a terminal's input after the key's revocation: %d, want 401", w.Code)
	}
	// The page asks who it is signed in as when it loads: a revoked key's
	// session is no one, not the key with a CSRF token to use.
	cookie, _ = func() (string, string) { revoked.Store(false); defer revoked.Store(true); return signIn(t, s) }()
	time.Sleep(2 * keyRecheck)
	if w := do(s, "GET", "/ui/session", "", map[string]string{"Cookie": cookie}); w.Code != http.StatusUnauthorized {
		t.Errorf("who the session is after its key's revocation: %d %s, want 401", w.Code, w.Body)
	}
}

// TestExpiredSessionTellsItsStreams: a session that goes idle past
// ui.session_idle while its page holds a stream (which does not keep it
// alive) ends the stream with an "expired" event, whichever of the stream's
// own tick and the session check finds it first (found in a full run: the
// check cut the stream silently, the browser's reconnect was refused, and
// the page never went back to sign-in).
func TestExpiredSessionTellsItsStreams(t *testing.T) {
	defer func(d time.Duration) { keyRecheck = d }(keyRecheck)
	keyRecheck = 50 * time.Millisecond // well before the list's tick
	s := New(Config{API: &fakeAPI{}, Proxy: "http://127.0.0.1:1", SessionIdle: 300 * time.Millisecond,
		Verify: func(key string) (Identity, error) {
			if key != goodKey {
				return Identity{}, ErrBadKey
			}
			return Identity{KeyID: "key_1", Name: "k"}, nil
		}})
	srv := httptest.NewServer(s)
	defer srv.Close()
	cookie, _ := signIn(t, s)
	req, _ := http.NewRequest("GET", srv.URL+"/ui/events/sandboxes", nil)
	req.Header.Set("Cookie", cookie)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("open a stream: %v %v", err, resp)
	}
	defer resp.Body.Close()
	ended := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(resp.Body); ended <- b }()
	select {
	case b := <-ended:
		if !bytes.Contains(b, []byte("event: expired\n")) {
			t.Errorf("the stream of an expired session ended without saying so: %q", b)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the stream of a session idle past its limit is still open 20 s later")
	}
	if code := do(s, "GET", "/ui/session", "", map[string]string{"Cookie": cookie}).Code; code != http.StatusUnauthorized {
		t.Errorf("the session after its idle limit: %d, want 401", code)
	}
}

// TestTemplatesErrorNamesNoHostPath: when the template store cannot be
// listed (here a corrupt record), /ui/templates, which every key may read,
// says what failed without the store's path on the host; the path goes to
// the log under the request id the page shows (found by review,
// 2026-12-03: "template store: " and the raw error, path and all).
func TestTemplatesErrorNamesNoHostPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "srv-ops-templates")
	st, err := imgstore.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "templates", "broken.json"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := st.List(); err == nil || !strings.Contains(err.Error(), dir) {
		t.Fatalf("the store's error %v: the test wants one naming its path", err)
	}
	var log strings.Builder
	s, _, _ := newTest(t)
	s.log = slog.New(slog.NewTextHandler(&log, nil))
	s.cfg.Templates = func() ([]Template, error) {
		_, err := st.List()
		return nil, err
	}
	cookie, _ := signIn(t, s)
	w := do(s, "GET", "/ui/templates", "", map[string]string{"Cookie": cookie})
	var e errorJSON
	if w.Code != http.StatusInternalServerError || json.Unmarshal(w.Body.Bytes(), &e) != nil {
		t.Fatalf("/ui/templates with a corrupt store: %d %s", w.Code, w.Body)
	}
	if strings.Contains(e.Message, "srv-ops") || !strings.HasPrefix(e.Message, `cannot list the template store: template "broken" (request `) {
		t.Errorf("the page is told %q: want what failed, without the host's path", e.Message)
	}
	_, id, ok := strings.Cut(e.Message, "(request ")
	id, _, _ = strings.Cut(id, ";")
	if !ok || id == "" || !strings.Contains(log.String(), id) || !strings.Contains(log.String(), dir) {
		t.Errorf("the log %q does not hold the path under the request id of %q", log.String(), e.Message)
	}
}

// TestTemplatesSourceForTenants: the templates page, which every key
// reads, tells a key that is not an admin's where a template came from
// only as its kind: its source names the operator's files on the host
// (an import's archive, a Dockerfile's path), its private registry, and
// the admin key that built it through the API. Admin keys see it whole.
// (Found by review, 2026-12-04: every tenant read them all.)
func TestTemplatesSourceForTenants(t *testing.T) {
	sources := map[string]string{
		"a": "docker-archive:/root/clients/acme/app.tar",
		"b": "oci-layout:/srv/ops/layouts/b",
		"c": "dockerfile:/home/alice/secret-project/Dockerfile",
		"d": "registry:registry.corp.internal:5000/team/app:latest",
		"e": "api build bld_123 by key key_admin9",
		"f": "built in: this host's /usr and a minimal /etc, read-only",
	}
	want := map[string]string{"a": "docker-archive", "b": "oci-layout", "c": "dockerfile", "d": "registry",
		"e": "api build", "f": sources["f"]}
	for _, admin := range []bool{false, true} {
		s, _, _ := newTest(t)
		s.cfg.Verify = func(key string) (Identity, error) {
			if key != goodKey {
				return Identity{}, ErrBadKey
			}
			return Identity{KeyID: "key_1", Name: "k", Admin: admin}, nil
		}
		s.cfg.Templates = func() ([]Template, error) {
			var out []Template
			for _, n := range []string{"a", "b", "c", "d", "e", "f"} {
				out = append(out, Template{Name: n, Source: sources[n]})
			}
			return out, nil
		}
		cookie, _ := signIn(t, s)
		w := do(s, "GET", "/ui/templates", "", map[string]string{"Cookie": cookie})
		var got struct{ Templates []Template }
		if w.Code != http.StatusOK || json.Unmarshal(w.Body.Bytes(), &got) != nil || len(got.Templates) != len(sources) {
			t.Fatalf("admin %v: /ui/templates: %d %s", admin, w.Code, w.Body)
		}
		for _, tm := range got.Templates {
			exp := want[tm.Name]
			if admin {
				exp = sources[tm.Name]
			}
			if tm.Source != exp {
				t.Errorf("admin %v: template %s's source shown as %q, want %q", admin, tm.Name, tm.Source, exp)
			}
		}
	}
}

// runningAPI answers every sandbox lookup with a running sandbox.
type runningAPI struct{}

func (runningAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"sandboxID":"sb1","state":"running","envdAccessToken":"tok"}`)
}

// endlessAgent serves GET /files as a file that never ends (a sparse
// file of terabytes in the sandbox) and counts the downloads in flight.
func endlessAgent(t *testing.T, inFlight *atomic.Int32) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inFlight.Add(1)
		defer inFlight.Add(-1)
		w.WriteHeader(http.StatusOK)
		buf := make([]byte, 32<<10)
		for r.Context().Err() == nil {
			if _, err := w.Write(buf); err != nil {
				return
			}
		}
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true) // the agent client speaks h2c
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// TestDownloadsBounded: a download holds a connection through the proxy
// (the loopback address's, shared by every tenant's dashboard) and a
// stream of the agent for as long as it lasts, so it counts as a live page
// does (maxStreams a session), is ended by a client that stops reading
// (downloadIdle with no byte taken) and by its session's end (the key's
// revocation). Found by review, 2026-12-04: downloads were unbounded in
// number, had no write deadline at all, and outlived their session, so one
// session whose browser read nothing held the proxy's connections of the
// loopback address (4,096) for good.
func TestDownloadsBounded(t *testing.T) {
	defer func(d, i time.Duration) { keyRecheck, downloadIdle = d, i }(keyRecheck, downloadIdle)
	keyRecheck, downloadIdle = 50*time.Millisecond, 300*time.Millisecond
	var inFlight atomic.Int32
	agent := endlessAgent(t, &inFlight)
	var revoked atomic.Bool
	s := New(Config{API: runningAPI{}, Proxy: agent.URL,
		Verify: func(key string) (Identity, error) {
			if key != goodKey || revoked.Load() {
				return Identity{}, ErrBadKey
			}
			return Identity{KeyID: "key_1", Name: "k"}, nil
		}})
	srv := httptest.NewServer(s)
	defer srv.Close()
	cookie, _ := signIn(t, s)
	get := func() (*http.Response, error) {
		req, _ := http.NewRequest("GET", srv.URL+"/ui/files/sb1/download?path=/big", nil)
		req.Header.Set("Cookie", cookie)
		return (&http.Client{Transport: &http.Transport{}}).Do(req) // a connection each
	}
	waitFor := func(what string, n int32) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for inFlight.Load() != n {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d downloads in flight at the agent, want %d", what, inFlight.Load(), n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	// A browser that stops reading: its download ends.
	resp, err := get()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("download: %v %v", err, resp)
	}
	waitFor("a download whose client reads nothing", 0)
	resp.Body.Close()

	// At most maxStreams at once, each read as it comes.
	var bodies []io.ReadCloser
	defer func() {
		for _, b := range bodies {
			b.Close()
		}
	}()
	for i := 0; i < maxStreams; i++ {
		resp, err := get()
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("download %d: %v %v", i, err, resp)
		}
		bodies = append(bodies, resp.Body)
		go func() { _, _ = io.Copy(io.Discard, resp.Body) }()
	}
	resp, err = get()
	if err != nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("download %d: %v %v, want 429", maxStreams+1, err, resp)
	}
	resp.Body.Close()
	waitFor("downloads read as they come", maxStreams)

	// An upload counts as a download does.
	csrf := ""
	{
		w := do(s, "GET", "/ui/session", "", map[string]string{"Cookie": cookie})
		var sj sessionJSON
		_ = json.Unmarshal(w.Body.Bytes(), &sj)
		csrf = sj.CSRF
	}
	req, _ := http.NewRequest("POST", srv.URL+"/ui/files/sb1/upload?path=/x", strings.NewReader("0123456789"))
	req.Header.Set("Cookie", cookie)
	req.Header.Set(csrfHeader, csrf)
	resp, err = (&http.Client{Transport: &http.Transport{}}).Do(req)
	if err != nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("an upload beside %d downloads: %v %v, want 429", maxStreams, err, resp)
	}
	resp.Body.Close()

	// The key revoked: they end with the session.
	revoked.Store(true)
	waitFor("downloads after the key's revocation", 0)
}

// A request the session's browser sends from another site (a sibling
// subdomain is same-site, and SameSite=Strict sends it the cookie: a
// sandbox's page under the same parent domain) is refused, and does not
// count as use: a hostile page left open could otherwise keep its
// visitor's dashboard session from ever idling out, up to its absolute
// age.
func TestRefusedRequestsKeepNoSessionAlive(t *testing.T) {
	s, api, c := newTest(t)
	cookie, _ := signIn(t, s)
	for _, site := range []string{"same-site", "cross-site"} {
		for i := 0; i < 4; i++ { // two hours of polls, each within the idle spell
			c.add(DefaultSessionIdle / 2)
			for _, p := range []string{"/ui/session", "/ui/api/v2/sandboxes", "/ui/templates"} {
				if w := do(s, "GET", p, "", map[string]string{"Cookie": cookie, "Sec-Fetch-Site": site}); w.Code != 403 {
					t.Fatalf("GET %s from a %s page: %d %s, want 403", p, site, w.Code, w.Body)
				}
			}
		}
		if w := do(s, "GET", "/ui/session", "", map[string]string{"Cookie": cookie}); w.Code != 401 {
			t.Fatalf("after %s requests only, for longer than the idle spell: %d, want 401 (they kept the session alive)", site, w.Code)
		}
		cookie, _ = signIn(t, s)
	}
	if api.count() != 0 {
		t.Fatalf("refused requests reached the API (%d)", api.count())
	}
}
