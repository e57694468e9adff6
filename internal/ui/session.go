package ui

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ErrBadKey is a key that does not sign in (unknown or revoked).
var ErrBadKey = errors.New("invalid API key")

const (
	cookieName = "cage_ui"
	csrfHeader = "X-CSRF-Token"
	// maxSessions bounds the sessions kept: sign-ins past it end the
	// oldest unused ones first.
	maxSessions = 10000
	// maxKeySessions bounds one key's sessions, so that a key holder who
	// signs in in a loop ends its own oldest sessions, not other teams'.
	maxKeySessions = 64
)

type session struct {
	id, csrf, key string
	who           Identity
	created, seen time.Time
	streams       atomic.Int32 // event streams open (holdStream)
	verified      atomic.Int64 // when its key was last found valid (UnixNano)
}

// keyRecheck is how often a session's key is checked again: a revoked
// key ends its sessions, their streams and terminals, within about this.
// (A variable for the tests.)
var keyRecheck = 2 * time.Second

// keyValid says whether ss's key still signs in, checking it again once
// keyRecheck has passed since the last check; a key that no longer does
// (revoked) ends the session with its terminals. A check that cannot be
// made now (the store busy) leaves the session as it is.
func (s *Server) keyValid(ss *session) bool {
	now := s.now()
	if now.Sub(time.Unix(0, ss.verified.Load())) < keyRecheck {
		return true
	}
	if _, err := s.cfg.Verify(ss.key); err != nil {
		if errors.Is(err, ErrBadKey) {
			s.sessions.remove(ss.id)
			s.terms.closeSession(ss.id)
			return false
		}
		s.log.Warn("ui: check a session's key", "err", err)
		return true
	}
	ss.verified.Store(now.UnixNano())
	return true
}

// maxStreams bounds a session's open event streams and terminals: each
// asks the API every tick.
const maxStreams = 16

// holdStream counts a stream against its session's bound (429 beyond);
// release it when the stream ends.
func holdStream(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	ss := sessionOf(r)
	if ss.streams.Add(1) > maxStreams {
		ss.streams.Add(-1)
		writeError(w, http.StatusTooManyRequests, "too many live pages and terminals open in this session")
		return nil, false
	}
	return func() { ss.streams.Add(-1) }, true
}

type sessions struct {
	mu        sync.Mutex
	m         map[string]*session
	idle, max time.Duration
	now       func() time.Time
}

func newSessions(idle, max time.Duration, now func() time.Time) *sessions {
	return &sessions{m: map[string]*session{}, idle: idle, max: max, now: now}
}

func randomID() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (ss *sessions) create(key string, who Identity) *session {
	now := ss.now()
	s := &session{id: randomID(), csrf: randomID(), key: key, who: who, created: now, seen: now}
	s.verified.Store(now.UnixNano())
	ss.mu.Lock()
	defer ss.mu.Unlock()
	var mine []*session
	for _, x := range ss.m {
		if x.key == key {
			mine = append(mine, x)
		}
	}
	for len(mine) >= maxKeySessions { // this key's least recently used goes
		oldest := 0
		for i, x := range mine {
			if x.seen.Before(mine[oldest].seen) {
				oldest = i
			}
		}
		delete(ss.m, mine[oldest].id)
		mine = append(mine[:oldest], mine[oldest+1:]...)
	}
	if len(ss.m) >= maxSessions {
		ss.sweepLocked(now)
	}
	for len(ss.m) >= maxSessions { // all live: the least recently used goes
		var old *session
		for _, x := range ss.m {
			if old == nil || x.seen.Before(old.seen) {
				old = x
			}
		}
		delete(ss.m, old.id)
	}
	ss.m[s.id] = s
	return s
}

func (ss *sessions) expired(s *session, now time.Time) bool {
	return now.Sub(s.seen) > ss.idle || now.Sub(s.created) > ss.max
}

func (ss *sessions) sweepLocked(now time.Time) {
	for id, s := range ss.m {
		if ss.expired(s, now) {
			delete(ss.m, id)
		}
	}
}

// get returns a live session and, if touch, marks it used now; an expired
// one is removed.
func (ss *sessions) get(id string, touch bool) (*session, bool) {
	now := ss.now()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.m[id]
	if !ok {
		return nil, false
	}
	if ss.expired(s, now) {
		delete(ss.m, id)
		return nil, false
	}
	if touch {
		s.seen = now
	}
	return s, true
}

func (ss *sessions) remove(id string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	delete(ss.m, id)
}

type sessionKey struct{}

// sessionOf is the request's session (set by authed).
func sessionOf(r *http.Request) *session {
	s, _ := r.Context().Value(sessionKey{}).(*session)
	return s
}

// alive says whether the request's session is still live (a stream's
// check, which does not count as use).
func (s *Server) alive(r *http.Request) bool {
	_, ok := s.sessions.get(sessionOf(r).id, false)
	return ok
}

// sameOrigin refuses a request a browser says came from another site: an
// Origin whose host is not the one the request was sent to (either
// scheme: behind a TLS proxy the browser's is https, cage's listener's
// http), or Sec-Fetch-Site other than same-origin (a browser's own
// navigation, "none", passes for GETs).
func sameOrigin(r *http.Request) error {
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host != r.Host || u.Path != "" {
			return errors.New("cross-origin request refused")
		}
	}
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "", "same-origin":
	case "none":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			return errors.New("cross-origin request refused")
		}
	default:
		return errors.New("cross-origin request refused (Sec-Fetch-Site: " + site + ")")
	}
	return nil
}

func safeMethod(m string) bool { return m == http.MethodGet || m == http.MethodHead }

// authed requires a live session, and for a request that changes anything,
// this origin and the session's CSRF token; then runs next with the
// session in the context.
func (s *Server) authed(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The origin first: a refused request must not count as the
		// session's use (a page of another site, or a sandbox's under
		// the same parent domain, polling it kept it from idling out).
		if err := sameOrigin(r); err != nil {
			writeError(w, http.StatusForbidden, err.Error())
			return
		}
		c, err := r.Cookie(sessionCookie(r))
		if err != nil || c.Value == "" {
			writeError(w, http.StatusUnauthorized, "not signed in")
			return
		}
		ss, ok := s.sessions.get(c.Value, true)
		if !ok || !s.keyValid(ss) {
			clearCookie(w, r)
			writeError(w, http.StatusUnauthorized, "session expired, signed out or its key revoked: sign in again")
			return
		}
		if !safeMethod(r.Method) {
			got := r.Header.Get(csrfHeader)
			if got == "" || subtle.ConstantTimeCompare([]byte(got), []byte(ss.csrf)) != 1 {
				writeError(w, http.StatusForbidden, "missing or wrong CSRF token (X-CSRF-Token)")
				return
			}
		}
		next(w, r.WithContext(context.WithValue(r.Context(), sessionKey{}, ss)))
	})
}

type sessionJSON struct {
	CSRF     string   `json:"csrf"`
	Identity Identity `json:"identity"`
}

// signIn checks a key ({"key": "e2b_..."}) and starts a session.
func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if err := sameOrigin(r); err != nil {
		writeError(w, http.StatusForbidden, err.Error())
		return
	}
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		writeError(w, http.StatusUnsupportedMediaType, "sign in with a JSON body {\"key\": ...}")
		return
	}
	var body struct {
		Key string `json:"key"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&body); err != nil {
		writeError(w, http.StatusBadRequest, "sign in with a JSON body {\"key\": ...}")
		return
	}
	key := strings.TrimSpace(body.Key)
	if key == "" {
		writeError(w, http.StatusBadRequest, "an API key is required")
		return
	}
	who, err := s.cfg.Verify(key)
	if err != nil {
		if errors.Is(err, ErrBadKey) {
			s.record(r, Identity{}, http.StatusUnauthorized)
			writeError(w, http.StatusUnauthorized, "invalid API key")
			return
		}
		s.log.Error("ui: sign-in", "err", err)
		writeError(w, http.StatusInternalServerError, "cannot check the key now")
		return
	}
	ss := s.sessions.create(key, who)
	http.SetCookie(w, &http.Cookie{Name: sessionCookie(r), Value: ss.id, Path: cookiePath(r), HttpOnly: true,
		Secure: secure(r), SameSite: http.SameSiteStrictMode, MaxAge: int(s.cfg.SessionMax / time.Second)})
	s.record(r, who, http.StatusOK)
	writeJSON(w, http.StatusOK, sessionJSON{CSRF: ss.csrf, Identity: who})
}

func (s *Server) record(r *http.Request, who Identity, status int) {
	if s.cfg.Record != nil {
		s.cfg.Record(r, who, status)
	}
}

// whoami is the session's identity and CSRF token (401 when none).
func (s *Server) whoami(w http.ResponseWriter, r *http.Request) {
	if err := sameOrigin(r); err != nil { // as authed: no use of the session
		writeError(w, http.StatusForbidden, err.Error())
		return
	}
	c, err := r.Cookie(sessionCookie(r))
	if err != nil {
		writeError(w, http.StatusUnauthorized, "not signed in")
		return
	}
	ss, ok := s.sessions.get(c.Value, true)
	if !ok || !s.keyValid(ss) {
		clearCookie(w, r)
		writeError(w, http.StatusUnauthorized, "session expired, signed out or its key revoked: sign in again")
		return
	}
	writeJSON(w, http.StatusOK, sessionJSON{CSRF: ss.csrf, Identity: ss.who})
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request) {
	ss := sessionOf(r)
	s.sessions.remove(ss.id)
	s.terms.closeSession(ss.id)
	s.record(r, ss.who, http.StatusNoContent)
	clearCookie(w, r)
	w.WriteHeader(http.StatusNoContent)
}

// secure says whether the browser reached cage over TLS: its own, or a
// reverse proxy's that says so (X-Forwarded-Proto: a client that lies
// only makes its own cookie stricter).
func secure(r *http.Request) bool {
	return r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https")
}

// sessionCookie names the session cookie for r. Over TLS it is
// __Host-cage_ui, at path /: a browser takes a __Host- cookie only from
// this very host (Secure, no Domain, Path /), so a page of a sandbox
// served under the same parent domain (3000-ID.example.com beside
// cage.example.com) can neither set nor replace it: no session of a
// sandbox owner's choosing in another user's browser (cookie tossing).
// Over plain HTTP no browser offers that: cage_ui at /ui.
func sessionCookie(r *http.Request) string {
	if secure(r) {
		return "__Host-" + cookieName
	}
	return cookieName
}

func cookiePath(r *http.Request) string {
	if secure(r) {
		return "/"
	}
	return "/ui"
}

func clearCookie(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: sessionCookie(r), Value: "", Path: cookiePath(r), HttpOnly: true,
		Secure: secure(r), SameSite: http.SameSiteStrictMode, MaxAge: -1})
}

type errorJSON struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, errorJSON{Code: status, Message: msg})
}
