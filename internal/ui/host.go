package ui

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/api"
)

// current checks the session's key again (a key revoked since sign-in
// signs the session out) and returns what it is now.
func (s *Server) current(w http.ResponseWriter, r *http.Request) (Identity, bool) {
	ss := sessionOf(r)
	who, err := s.cfg.Verify(ss.key)
	if err != nil {
		if errors.Is(err, ErrBadKey) {
			s.sessions.remove(ss.id)
			writeError(w, http.StatusUnauthorized, "invalid API key")
			return who, false
		}
		writeError(w, http.StatusInternalServerError, "cannot check the key now")
		return who, false
	}
	return who, true
}

// templates lists the template store: every key may create from any of
// them, so every key sees them. Admin keys build them through the API's
// /admin/templates routes (builds.go streams a build's log).
func (s *Server) templates(w http.ResponseWriter, r *http.Request) {
	who, ok := s.current(w, r)
	if !ok {
		return
	}
	if s.cfg.Templates == nil {
		writeJSON(w, http.StatusOK, map[string]any{"templates": []Template{}})
		return
	}
	ts, err := s.cfg.Templates()
	if err != nil {
		// Every key reads this page: the store's paths on the host are
		// the operator's, in the log.
		msg, _ := api.WithoutHostPaths(err.Error())
		id := api.RequestID()
		s.log.Error("ui: list the template store", "request", id, "err", err)
		writeError(w, http.StatusInternalServerError, "cannot list the template store: "+msg+" (request "+id+"; the server's log has the detail)")
		return
	}
	if ts == nil {
		ts = []Template{}
	}
	if !who.Admin {
		for i := range ts {
			ts[i].Source = sourceKind(ts[i].Source)
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"templates": ts})
}

// sourceKind is where a template came from as a key that is not an
// admin's sees it: the kind only. A source names the operator's files
// on the host (an import's archive or layout, a Dockerfile's path), a
// registry of theirs, or the admin key that built it through the API,
// none of them a tenant's (found by review, 2026-12-04: every key read
// them whole here).
func sourceKind(src string) string {
	if strings.HasPrefix(src, "built in:") {
		return src // the host template's, the same on every host
	}
	for _, kind := range []string{"docker-archive", "oci-layout", "dockerfile", "registry"} {
		if strings.HasPrefix(src, kind+":") {
			return kind
		}
	}
	if strings.HasPrefix(src, "api build") {
		return "api build"
	}
	return ""
}

// host is what the daemon says of its host (walls, pools, capacity): for
// admin keys only, as the /admin routes are.
func (s *Server) host(w http.ResponseWriter, r *http.Request) {
	who, ok := s.current(w, r)
	if !ok {
		return
	}
	if !who.Admin {
		writeError(w, http.StatusForbidden, "the host page is for admin keys")
		return
	}
	if s.cfg.Host == nil {
		writeError(w, http.StatusNotFound, "this daemon does not describe its host")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 20*time.Second)
	defer cancel()
	v, err := s.cfg.Host(ctx)
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, v)
}
