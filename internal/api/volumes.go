package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/volume"
)

// Volumes, E2B's Volume API. The control routes (/volumes) take the API
// key like every other; the content routes (/volumecontent/{volumeID}/...,
// E2B's second base URL, served on this same listener) take the volume's
// own bearer token, checked (in constant time, by the manager) before a
// byte of the body is read, and answer errors in E2B's shape for them,
// {code: word, message}.

// volumeRoutes registers the volume routes on mux.
func (s *server) volumeRoutes(mux *http.ServeMux) {
	auth := s.authenticated
	mux.Handle("POST /volumes", auth(http.HandlerFunc(s.createVolume)))
	mux.Handle("GET /volumes", auth(http.HandlerFunc(s.listVolumes)))
	mux.Handle("GET /volumes/{volumeID}", auth(http.HandlerFunc(s.getVolume)))
	mux.Handle("DELETE /volumes/{volumeID}", auth(http.HandlerFunc(s.deleteVolume)))
	c := s.volumeToken
	mux.Handle("GET /volumecontent/{volumeID}/path", c(s.statPath))
	mux.Handle("PATCH /volumecontent/{volumeID}/path", c(s.updatePath))
	mux.Handle("DELETE /volumecontent/{volumeID}/path", c(s.removePath))
	mux.Handle("GET /volumecontent/{volumeID}/dir", c(s.listDir))
	mux.Handle("POST /volumecontent/{volumeID}/dir", c(s.makeDir))
	mux.Handle("GET /volumecontent/{volumeID}/file", c(s.readFile))
	mux.Handle("PUT /volumecontent/{volumeID}/file", c(s.writeFile))
	mux.HandleFunc("/volumecontent/", func(w http.ResponseWriter, r *http.Request) {
		writeContentError(w, http.StatusNotFound, "not_found", "no such route: "+r.Method+" "+r.URL.Path)
	})
}

func (s *server) volumeAndToken(v *store.Volume) types.VolumeAndToken {
	return types.VolumeAndToken{VolumeID: v.ID, Name: v.Name, Token: v.Token, Domain: s.cfg.Domain}
}

func (s *server) createVolume(w http.ResponseWriter, r *http.Request) {
	var body types.NewVolume
	if err := decode(r, &body, false); err != nil {
		s.fail(w, r, err)
		return
	}
	v, err := s.cfg.Manager.CreateVolume(keyID(r), body.Name)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.volumeAndToken(v))
}

func (s *server) listVolumes(w http.ResponseWriter, r *http.Request) {
	vs, err := s.cfg.Manager.Volumes(keyID(r))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := make([]types.Volume, 0, len(vs))
	for _, v := range vs {
		out = append(out, types.Volume{VolumeID: v.ID, Name: v.Name})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *server) getVolume(w http.ResponseWriter, r *http.Request) {
	v, err := s.cfg.Manager.Volume(keyID(r), r.PathValue("volumeID"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.volumeAndToken(v))
}

func (s *server) deleteVolume(w http.ResponseWriter, r *http.Request) {
	if err := s.cfg.Manager.DeleteVolume(keyID(r), r.PathValue("volumeID")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeMountsOf is a create body's volume mounts as the manager's.
func volumeMountsOf(in []types.SandboxVolumeMount) []manager.VolumeMount {
	var out []manager.VolumeMount
	for _, m := range in {
		out = append(out, manager.VolumeMount{Name: m.Name, Path: m.Path})
	}
	return out
}

// mountsOf is a sandbox's volume mounts as the API shows them.
func mountsOf(rec *store.Sandbox) []types.SandboxVolumeMount {
	var out []types.SandboxVolumeMount
	for _, m := range rec.VolumeMounts {
		out = append(out, types.SandboxVolumeMount{Name: m.Name, Path: m.Path})
	}
	return out
}

// The content API.

// contentHandler is a content route's handler, given the volume's root.
type contentHandler func(w http.ResponseWriter, r *http.Request, root *volume.Root)

// volumeToken checks the request's bearer token for the route's volume,
// then its owner's rate, then opens the volume, before anything of the
// request's body is read; then (an upload may be
// long) the listener's one-minute bound on reading a request gives way to
// an hour, as E2B's SDK allows its file operations, as long as the body
// keeps coming: one through which no byte arrives for contentIdle is
// ended (see idleBody).
func (s *server) volumeToken(h contentHandler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth := r.Header.Get("Authorization")
		token, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok || token == "" {
			writeContentError(w, http.StatusUnauthorized, "unauthorized", "missing volume token: send Authorization: Bearer <the volume's token>")
			return
		}
		grant, err := s.cfg.Manager.CheckVolumeToken(r.PathValue("volumeID"), token)
		if err != nil {
			s.contentFail(w, r, err)
			return
		}
		owner := grant.Volume.KeyID
		key, team := audit.SplitOwner(owner)
		noteKey(r, key, team) // the audit trail's: the volume's owner
		// The owner's rate before the volume is opened: opening may mount
		// it on the host (a loop device, a file system's mount). Found by
		// review, 2026-12-05: a token over its owner's rate had the volume
		// mounted for each request it was refused.
		if !s.allowContent(w, r, owner) {
			return
		}
		root, err := grant.Open()
		if err != nil {
			s.contentFail(w, r, err)
			return
		}
		defer root.Close()
		if _, err := s.cfg.Store.GetVolume("", grant.Volume.ID); errors.Is(err, store.ErrNotFound) {
			writeContentError(w, http.StatusNotFound, "not_found", "no such volume") // deleted meanwhile
			return
		} else if err != nil {
			s.contentFail(w, r, err)
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), volumeOwnerKey{}, owner))
		rc := http.NewResponseController(w)
		whole := time.Now().Add(contentWhole)
		if r.Body != nil && r.Body != http.NoBody {
			r.Body = &idleBody{ReadCloser: r.Body, rc: rc, whole: whole}
			_ = rc.SetReadDeadline(earlier(whole, time.Now().Add(contentIdle)))
		} else {
			_ = rc.SetReadDeadline(whole)
		}
		h(w, r, root)
	})
}

// contentWhole bounds a content request's whole body; contentIdle the
// time between two of its reads that bring bytes. Found by review,
// 2026-12-03: a token holder got the hour for each request whether its
// body moved or not, so it could keep its address's 4,096 connections
// for an hour with nothing sent.
var (
	contentWhole = time.Hour
	contentIdle  = time.Minute
)

// idleBody moves the connection's read deadline contentIdle ahead each
// time a read brings bytes (never past whole), and to whole once the body
// is read, so that the answer's writing is not cut.
type idleBody struct {
	io.ReadCloser
	rc    *http.ResponseController
	whole time.Time
}

func (b *idleBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err != nil:
		_ = b.rc.SetReadDeadline(b.whole)
	case n > 0:
		_ = b.rc.SetReadDeadline(earlier(b.whole, time.Now().Add(contentIdle)))
	}
	return n, err
}

func writeContentError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, types.VolumeContentError{Code: code, Message: msg})
}

// contentFail maps an error kind to its status and E2B's code word.
func (s *server) contentFail(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, manager.ErrUnauthorized):
		writeContentError(w, http.StatusUnauthorized, "unauthorized", err.Error())
	case errors.Is(err, volume.ErrNotFound):
		writeContentError(w, http.StatusNotFound, "not_found", err.Error())
	case errors.Is(err, volume.ErrInvalid), errors.Is(err, volume.ErrTooLarge), errors.Is(err, errBadRequest):
		writeContentError(w, http.StatusBadRequest, "bad_request", err.Error())
	case errors.Is(err, volume.ErrExists):
		writeContentError(w, http.StatusConflict, "conflict", err.Error())
	case errors.Is(err, volume.ErrNoSpace):
		writeContentError(w, http.StatusInsufficientStorage, "insufficient_storage", err.Error())
	case errors.Is(err, sandbox.ErrUnavailable), errors.Is(err, volume.ErrUnavailable):
		// As the API's own routes: no host path (the token's holder is
		// no operator).
		writeContentError(w, http.StatusInternalServerError, "internal", s.unavailable(r, err))
	default:
		id := requestID()
		s.log.Error("volume request failed", "route", r.Method+" "+r.URL.Path, "request", id, "err", err)
		writeContentError(w, http.StatusInternalServerError, "internal", "internal error (request "+id+"; the server's log has the detail)")
	}
}

func entryJSON(e volume.Entry) types.VolumeEntryStat {
	return types.VolumeEntryStat{Name: e.Name, Path: e.Path, Type: types.VolumeEntryStatType(e.Type), Size: e.Size,
		Mode: int64(e.Mode), UID: int64(e.UID), GID: int64(e.GID), Atime: e.Atime, Mtime: e.Mtime, Ctime: e.Ctime, Target: e.Target}
}

// contentQuery reads the path and, where a route takes them, uid, gid,
// mode and force.
func contentQuery(r *http.Request) (string, volume.Meta, bool, error) {
	q := r.URL.Query()
	p := q.Get("path")
	if p == "" {
		return "", volume.Meta{}, false, fmt.Errorf("%w: the path parameter is required", errBadRequest)
	}
	var meta volume.Meta
	for name, dst := range map[string]**uint32{"uid": &meta.UID, "gid": &meta.GID, "mode": &meta.Mode} {
		v := q.Get(name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return "", meta, false, fmt.Errorf("%w: %s %q is not a number", errBadRequest, name, v)
		}
		u := uint32(n)
		*dst = &u
	}
	force := false
	if v := q.Get("force"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return "", meta, false, fmt.Errorf("%w: force %q: want true or false", errBadRequest, v)
		}
		force = b
	}
	return p, meta, force, nil
}

func (s *server) statPath(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, _, _, err := contentQuery(r)
	var e volume.Entry
	if err == nil {
		e, err = root.Stat(p)
	}
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, entryJSON(e))
}

func (s *server) updatePath(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, _, _, err := contentQuery(r)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	var body types.VolumeMetadata
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if err := decode(r, &body, false); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeContentError(w, http.StatusRequestEntityTooLarge, "request_too_large", "the metadata body is larger than 64 KiB")
			return
		}
		s.contentFail(w, r, fmt.Errorf("%w: %v", errBadRequest, err))
		return
	}
	var meta volume.Meta
	for _, f := range []struct {
		in  *int64
		out **uint32
	}{{body.UID, &meta.UID}, {body.GID, &meta.GID}, {body.Mode, &meta.Mode}} {
		if f.in == nil {
			continue
		}
		if *f.in < 0 || *f.in > 1<<32-1 {
			s.contentFail(w, r, fmt.Errorf("%w: uid, gid and mode must be positive", errBadRequest))
			return
		}
		v := uint32(*f.in)
		*f.out = &v
	}
	e, err := root.SetMeta(p, meta)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, entryJSON(e))
}

func (s *server) removePath(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, _, _, err := contentQuery(r)
	if err == nil {
		err = root.Remove(p)
	}
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeOwnerKey is the context's key of a content request's volume's
// owner (volumeToken).
type volumeOwnerKey struct{}

// listDir lists a directory of the volume: at most maxListsInFlight
// listings of an owner's volumes at once (429 beyond), each written an
// entry at a time. A listing holds up to 16 MiB of names (volume's
// bound) for as long as its client takes to read it (a write may wait
// 30 s), and it was encoded whole besides: a token holder that read none
// of its answers held that on each connection its address may open
// (found by review, 2026-12-04).
func (s *server) listDir(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	owner, _ := r.Context().Value(volumeOwnerKey{}).(string)
	release, ok := s.holdList(&s.contentLists, owner)
	if !ok {
		w.Header().Set("Retry-After", "1")
		s.cfg.Metrics.RateLimited("lists")
		writeContentError(w, http.StatusTooManyRequests, "rate_limited", fmt.Sprintf(
			"%d listings of this owner's volumes are in flight, the most at once: retry when one has ended", maxListsInFlight))
		return
	}
	defer release()
	p, _, _, err := contentQuery(r)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	depth := 1
	if v := r.URL.Query().Get("depth"); v != "" {
		if depth, err = strconv.Atoi(v); err != nil {
			s.contentFail(w, r, fmt.Errorf("%w: depth %q is not a number", errBadRequest, v))
			return
		}
	}
	es, err := root.List(p, depth)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	lw := listWriter{w: w}
	for _, e := range es {
		lw.add(entryJSON(e))
	}
	lw.end("")
}

func (s *server) makeDir(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, meta, force, err := contentQuery(r)
	var e volume.Entry
	if err == nil {
		e, err = root.MakeDir(p, meta, force)
	}
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, entryJSON(e))
}

func (s *server) readFile(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, _, _, err := contentQuery(r)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	f, e, err := root.Open(p)
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(e.Size, 10))
	w.WriteHeader(http.StatusOK)
	// A file that grows while it is read is cut at the size announced.
	_, _ = io.Copy(w, io.LimitReader(f, e.Size))
}

func (s *server) writeFile(w http.ResponseWriter, r *http.Request, root *volume.Root) {
	p, meta, force, err := contentQuery(r)
	var e volume.Entry
	if err == nil {
		e, err = root.Write(p, r.Body, meta, force)
	}
	if err != nil {
		s.contentFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, entryJSON(e))
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
