package api

import (
	"fmt"
	"net/http"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

func snapshotOf(sn *store.Snapshot) types.SnapshotInfo {
	return types.SnapshotInfo{SnapshotID: manager.SnapshotRef(sn), Names: manager.SnapshotNames(sn), SandboxID: sn.SandboxID,
		CreatedAt: sn.CreatedAt.UTC(), Kind: types.SnapshotInfoKind(sn.Kind), Size: sn.Size}
}

// createSnapshot saves a running sandbox's files as a snapshot: 201.
func (s *server) createSnapshot(w http.ResponseWriter, r *http.Request) {
	var body types.SnapshotRequest
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	sn, err := s.cfg.Manager.Snapshot(r.Context(), keyID(r), r.PathValue("sandboxID"), body.Name)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, snapshotOf(sn))
}

// listSnapshots is a page of the key's snapshots, newest first.
func (s *server) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit, err := atoiDefault(q.Get("limit"), 100)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if limit < 1 || limit > 100 {
		s.fail(w, r, fmt.Errorf("%w: limit must be between 1 and 100", errBadRequest))
		return
	}
	items, next, err := s.cfg.Manager.Snapshots(store.SnapshotFilter{KeyID: keyID(r), SandboxID: q.Get("sandboxID"),
		Name: q.Get("name"), Limit: limit, Cursor: q.Get("nextToken")})
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	out := make([]types.SnapshotInfo, 0, len(items))
	for _, sn := range items {
		out = append(out, snapshotOf(sn))
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteTemplate deletes a snapshot (E2B's deleteSnapshot): 204 or 404.
func (s *server) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	if err := s.cfg.Manager.DeleteSnapshot(keyID(r), r.PathValue("templateID")); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// fork makes count sandboxes from a running sandbox's snapshot: 201 with
// one entry a fork, its sandbox or its error (E2B's SandboxForkResult).
func (s *server) fork(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Cluster != nil {
		// A fork would be a sandbox without a pod: no other node would
		// see it, and the node's reconciliation would destroy it.
		s.fail(w, r, fmt.Errorf("%w: fork is not available in cluster mode yet", manager.ErrConflict))
		return
	}
	var body types.SandboxForkRequest
	if err := decode(r, &body, true); err != nil {
		s.fail(w, r, err)
		return
	}
	count, timeout := int(body.Count), time.Duration(body.Timeout)*time.Second
	if count == 0 {
		count = 1
	}
	if body.Timeout == 0 {
		timeout = 15 * time.Second // E2B's default
	}
	if body.Timeout < 0 {
		s.fail(w, r, fmt.Errorf("%w: timeout must be at least 1 second", errBadRequest))
		return
	}
	// Each sandbox of a fork is a create: a fork of n costs n of the
	// key's create tokens (a count out of range is the manager's 400).
	if count >= 1 && count <= manager.MaxFork && !s.allowCreates(w, r, count) {
		return
	}
	forks, err := s.cfg.Manager.Fork(r.Context(), keyID(r), r.PathValue("sandboxID"), count, timeout)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	out := make([]types.SandboxForkResult, len(forks))
	for i, f := range forks {
		if f.Err != nil {
			code, msg := s.failure(r, f.Err)
			out[i].Error = types.Error{Code: int32(code), Message: msg}
			continue
		}
		out[i].Sandbox = s.sandboxOf(f.Sandbox)
	}
	writeJSON(w, http.StatusCreated, out)
}
