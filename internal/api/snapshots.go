package api

import (
	"fmt"
	"net/http"

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
