package api

import (
	"context"
	"net/http"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// Cluster is the cluster front (internal/cluster.Front) in cluster mode:
// creates and lists go through it instead of this host's manager, and a
// request for a sandbox on another node is forwarded there. The API's
// checks (key, rates, validation, the team's quotas) come first, as on
// one host.
type Cluster interface {
	Create(ctx context.Context, req manager.CreateRequest) (*store.Sandbox, error)
	List(f store.ListFilter) ([]*store.Sandbox, string, error)
	// Forward serves a request for sandbox id when it is on another node
	// (owner: the calling key's owner) and reports whether it did.
	Forward(w http.ResponseWriter, r *http.Request, id, owner string) bool
	// Killed is told of a sandbox killed on this node, before the kill
	// is answered (the front deletes its pod).
	Killed(ctx context.Context, id string)
	// Forwarded says whether r was forwarded by another node (its node
	// signature verifies): that node took the key's rates already.
	Forwarded(r *http.Request) bool
}

// forwarded says whether r comes from another node of the cluster, whose
// front took the calling key's request and create rates: they are not
// taken twice.
func (s *server) forwarded(r *http.Request) bool {
	return s.cfg.Cluster != nil && r.Header.Get("X-Cage-Node-Auth") != "" && s.cfg.Cluster.Forwarded(r)
}

// routed answers a request for a sandbox on another node through the
// cluster front; others go to next.
func (s *server) routed(next http.Handler) http.Handler {
	if s.cfg.Cluster == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.cfg.Cluster.Forward(w, r, r.PathValue("sandboxID"), keyID(r)) {
			return
		}
		next.ServeHTTP(w, r)
	})
}

// createSandbox makes a sandbox: in the cluster when there is one, else
// on this host.
func (s *server) createSandbox(ctx context.Context, req manager.CreateRequest) (*store.Sandbox, error) {
	if s.cfg.Cluster != nil {
		return s.cfg.Cluster.Create(ctx, req)
	}
	return s.cfg.Manager.Create(ctx, req)
}

// listSandboxes lists the cluster's sandboxes when there is a cluster,
// else this host's.
func (s *server) listSandboxes(f store.ListFilter) ([]*store.Sandbox, string, error) {
	if s.cfg.Cluster != nil {
		return s.cfg.Cluster.List(f)
	}
	return s.cfg.Manager.List(f)
}
