package interp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

// executeRequest is E2B's ExecutionRequest.
type executeRequest struct {
	Code      *string           `json:"code"`
	ContextID *string           `json:"context_id"`
	Language  *string           `json:"language"`
	EnvVars   map[string]string `json:"env_vars"`
}

// envName is what a run's environment variable may be called.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// checkEnv refuses names no shell could set and values no process can hold.
func checkEnv(env map[string]string) error {
	for k, v := range env {
		if !envName.MatchString(k) {
			return fmt.Errorf("%w: env_vars: %q is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)", errBadRequest, truncate(k, 60))
		}
		if strings.ContainsRune(v, 0) {
			return fmt.Errorf("%w: env_vars: the value of %s holds a NUL byte", errBadRequest, k)
		}
	}
	return nil
}

// restartTimeout bounds the restart of a kernel that ignored an interrupt.
const restartTimeout = 2 * time.Minute

// execute is POST /execute: it runs code in a context and streams what
// the run produces, one JSON line each, ending with end_of_execution. A
// client that goes away interrupts the run; the context stays.
func (s *Server) execute(w http.ResponseWriter, r *http.Request) {
	var req executeRequest
	if !s.decodeBody(w, r, &req, false) {
		return
	}
	if req.Code == nil {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"detail": "code is required"})
		return
	}
	if req.ContextID != nil && req.Language != nil {
		writeText(w, http.StatusBadRequest, "Only one of context_id or language can be provided")
		return
	}
	if err := checkEnv(req.EnvVars); err != nil {
		s.fail(w, err)
		return
	}
	var c *codeContext
	if req.ContextID != nil {
		if c = s.context(*req.ContextID); c == nil {
			writeText(w, http.StatusNotFound, "Context %s not found", truncate(*req.ContextID, 100))
			return
		}
	} else {
		lang := ""
		if req.Language != nil {
			lang = *req.Language
		}
		var err error
		if c, err = s.defaultContext(r.Context(), lang); err != nil {
			s.fail(w, err)
			return
		}
	}
	if !c.acquire(r.Context()) {
		return // the client went away while an earlier run had the context
	}
	defer c.release()
	c.endedBy() // a restart before this run is no news to it
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	out := newStream(w, s.cfg.MaxOutput)
	defer out.close()
	if err := c.kernel.Exited(); err != nil {
		out.Error(kernelGone(c, err))
		return
	}
	err := c.kernel.Execute(r.Context(), *req.Code, req.EnvVars, out)
	switch {
	case err == nil:
	case errors.Is(err, jupyter.ErrNotInterrupted):
		// The kernel ignored the interrupt (code in a C loop, a trap):
		// the next run must not wait behind it, so its state goes.
		s.log.Warn("a run went on after its interrupt; restarting its kernel", "context", c.ID)
		out.Error("ContextRestarting", "the run did not stop when interrupted, so the context was restarted and its state is lost", "")
		ctx, cancel := context.WithTimeout(context.Background(), restartTimeout)
		defer cancel()
		if err := c.kernel.Restart(ctx); err != nil {
			s.log.Warn("restart context", "context", c.ID, "err", err)
		}
	default:
		out.Error(kernelGone(c, err))
	}
}
