package api

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// The admin API: teams and keys, for an admin key only (made on the host
// with `cage keys create --admin`); any other key gets 403 before its
// body is read. Every change is an audit entry of the admin key's
// (key.create, key.revoke, team.create, team.update, team.delete), beside
// the call's own.

var errForbidden = errors.New("forbidden")

func (s *server) adminRoutes(mux *http.ServeMux) {
	admin := func(h http.HandlerFunc) http.Handler { return s.authenticated(s.adminOnly(h)) }
	mux.Handle("GET /admin/teams", admin(s.listTeams))
	mux.Handle("POST /admin/teams", admin(s.createTeam))
	mux.Handle("GET /admin/teams/{teamID}", admin(s.getTeam))
	mux.Handle("PATCH /admin/teams/{teamID}", admin(s.updateTeam))
	mux.Handle("DELETE /admin/teams/{teamID}", admin(s.deleteTeam))
	mux.Handle("GET /admin/keys", admin(s.listKeys))
	mux.Handle("POST /admin/keys", admin(s.createKey))
	mux.Handle("DELETE /admin/keys/{keyID}", admin(s.revokeKey))
}

// adminOnly refuses a key that is not an admin key.
func (s *server) adminOnly(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k := callerOf(r); k == nil || !k.Admin {
			writeError(w, http.StatusForbidden, "this route is for an admin key (cage keys create --admin, on the host)")
			return
		}
		next(w, r)
	})
}

// adminEvent records an admin change in the trail, as the admin key's.
func (s *server) adminEvent(r *http.Request, kind string, detail map[string]any) {
	k := callerOf(r)
	s.cfg.Audit.Record(audit.Event{Kind: kind, KeyID: k.ID, TeamID: k.TeamID, Route: r.Pattern, Detail: detail})
}

// teamJSON is a team as the API shows it, with what it holds when usage.
func (s *server) teamJSON(t *store.Team, usage bool) (types.Team, error) {
	l := t.Limits
	out := types.Team{TeamID: t.ID, Name: t.Name, CreatedAt: t.CreatedAt,
		Quotas:     types.TeamQuotas{Sandboxes: l.Sandboxes, Cpus: l.CPUs, MemoryMB: l.Memory >> 20, DiskMB: l.Disk >> 20, Paused: l.Paused},
		RateLimits: types.TeamRateLimits{RequestsPerSecond: l.Requests, CreatesPerSecond: l.Creates}}
	if usage {
		u, err := s.cfg.Store.Usage(t.ID, manager.PauseMemory)
		if err != nil {
			return out, err
		}
		out.Usage = types.TeamUsage{Sandboxes: u.Sandboxes, Cpus: u.CPUs, MemoryMB: u.Memory >> 20, DiskMB: u.Disk >> 20, Paused: u.Paused}
	}
	return out, nil
}

// limitsOf reads quotas and rates from the API's form.
func limitsOf(q types.TeamQuotas, rl types.TeamRateLimits) (store.TeamLimits, error) {
	mem, err := bytesOfMiB("quotas.memoryMB", q.MemoryMB)
	if err != nil {
		return store.TeamLimits{}, err
	}
	disk, err := bytesOfMiB("quotas.diskMB", q.DiskMB)
	if err != nil {
		return store.TeamLimits{}, err
	}
	l := store.TeamLimits{Sandboxes: q.Sandboxes, CPUs: q.Cpus, Memory: mem, Disk: disk, Paused: q.Paused,
		Requests: rl.RequestsPerSecond, Creates: rl.CreatesPerSecond}
	if err := l.Valid(); err != nil {
		return l, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	return l, nil
}

// storeFail maps the store's kinds for the admin routes.
func (s *server) storeFail(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, store.ErrNotFound):
		err = fmt.Errorf("%w: %v", manager.ErrNotFound, unwrapStore(err))
	case errors.Is(err, store.ErrConflict):
		err = fmt.Errorf("%w: %v", manager.ErrConflict, unwrapStore(err))
	}
	s.fail(w, r, err)
}

// unwrapStore is a store error's text without its "store: " prefix.
func unwrapStore(err error) string {
	msg := err.Error()
	if len(msg) > 7 && msg[:7] == "store: " {
		return msg[7:]
	}
	return msg
}

func (s *server) listTeams(w http.ResponseWriter, r *http.Request) {
	ts, err := s.cfg.Store.ListTeams()
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := make([]types.Team, 0, len(ts))
	for _, t := range ts {
		j, err := s.teamJSON(t, true)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		out = append(out, j)
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) createTeam(w http.ResponseWriter, r *http.Request) {
	var body types.NewTeam
	if err := decode(r, &body, false); err != nil {
		s.fail(w, r, err)
		return
	}
	l, err := limitsOf(body.Quotas, body.RateLimits)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if !store.ValidTeamName(body.Name) {
		s.fail(w, r, fmt.Errorf("%w: team name %q: want 1 to 63 of a-z, 0-9, '-' and '_', starting with a letter or digit, not with %q",
			errBadRequest, body.Name, store.TeamPrefix))
		return
	}
	t, err := s.cfg.Store.CreateTeam(body.Name, l)
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	s.adminEvent(r, audit.KindTeamCreate, map[string]any{"team": t.ID, "name": t.Name, "limits": t.Limits})
	j, _ := s.teamJSON(t, false)
	writeJSON(w, http.StatusCreated, j)
}

func (s *server) getTeam(w http.ResponseWriter, r *http.Request) {
	t, err := s.cfg.Store.GetTeam(r.PathValue("teamID"))
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	j, err := s.teamJSON(t, true)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, j)
}

func (s *server) updateTeam(w http.ResponseWriter, r *http.Request) {
	var body types.TeamUpdate
	if err := decode(r, &body, false); err != nil {
		s.fail(w, r, err)
		return
	}
	t, err := s.cfg.Store.GetTeam(r.PathValue("teamID"))
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	cur := t.Limits
	q := types.TeamQuotas{Sandboxes: cur.Sandboxes, Cpus: cur.CPUs, MemoryMB: cur.Memory >> 20, DiskMB: cur.Disk >> 20, Paused: cur.Paused}
	rl := types.TeamRateLimits{RequestsPerSecond: cur.Requests, CreatesPerSecond: cur.Creates}
	if body.Quotas != nil {
		q = *body.Quotas
	}
	if body.RateLimits != nil {
		rl = *body.RateLimits
	}
	l, err := limitsOf(q, rl)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if err := s.cfg.Store.SetTeamLimits(t.ID, l); err != nil {
		s.storeFail(w, r, err)
		return
	}
	s.forgetTeam(t.ID)
	t.Limits = l
	s.adminEvent(r, audit.KindTeamUpdate, map[string]any{"team": t.ID, "name": t.Name, "limits": l})
	j, err := s.teamJSON(t, true)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, j)
}

func (s *server) deleteTeam(w http.ResponseWriter, r *http.Request) {
	t, err := s.cfg.Store.GetTeam(r.PathValue("teamID"))
	if err == nil {
		err = s.cfg.Store.DeleteTeam(t.ID)
	}
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	s.forgetTeam(t.ID)
	s.adminEvent(r, audit.KindTeamDelete, map[string]any{"team": t.ID, "name": t.Name})
	w.WriteHeader(http.StatusNoContent)
}

// KeyJSON is a key as the admin API shows it.
func KeyJSON(k *store.APIKey) types.APIKeyInfo {
	out := types.APIKeyInfo{KeyID: k.ID, Name: k.Name, Prefix: k.Prefix, TeamID: k.TeamID, Admin: k.Admin, CreatedAt: k.CreatedAt}
	if k.RevokedAt != nil {
		out.RevokedAt = *k.RevokedAt
	}
	if k.LastUsed != nil {
		out.LastUsed = *k.LastUsed
	}
	return out
}

func (s *server) listKeys(w http.ResponseWriter, r *http.Request) {
	ks, err := s.cfg.Store.ListKeys()
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := make([]types.APIKeyInfo, 0, len(ks))
	for _, k := range ks {
		out = append(out, KeyJSON(k))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) createKey(w http.ResponseWriter, r *http.Request) {
	var body types.NewAPIKey
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	if len(body.Name) > 128 {
		s.fail(w, r, fmt.Errorf("%w: name is at most 128 characters", errBadRequest))
		return
	}
	opts := store.KeyOptions{Name: body.Name}
	if body.TeamID != "" {
		t, err := s.cfg.Store.GetTeam(body.TeamID)
		if err != nil {
			s.storeFail(w, r, err)
			return
		}
		opts.TeamID = t.ID
	}
	plain, k, err := s.cfg.Store.CreateKeyWith(opts)
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	s.adminEvent(r, audit.KindKeyCreate, map[string]any{"key": k.ID, "name": k.Name, "prefix": k.Prefix, "team": k.TeamID})
	info := KeyJSON(k)
	writeJSON(w, http.StatusCreated, types.CreatedAPIKey{KeyID: info.KeyID, Name: info.Name, Prefix: info.Prefix,
		TeamID: info.TeamID, Admin: info.Admin, CreatedAt: info.CreatedAt, Key: plain})
}

func (s *server) revokeKey(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("keyID")
	ks, err := s.cfg.Store.ListKeys()
	if err != nil {
		s.fail(w, r, err)
		return
	}
	found := false
	for _, k := range ks {
		found = found || k.ID == id
	}
	if !found { // by id only: a prefix is the host's convenience
		s.fail(w, r, fmt.Errorf("%w: API key %q", manager.ErrNotFound, id))
		return
	}
	k, err := s.cfg.Store.RevokeKey(id)
	if err != nil {
		s.storeFail(w, r, err)
		return
	}
	s.adminEvent(r, audit.KindKeyRevoke, map[string]any{"key": k.ID, "name": k.Name, "prefix": k.Prefix, "team": k.TeamID})
	writeJSON(w, http.StatusOK, KeyJSON(k))
}
