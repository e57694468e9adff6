package ui

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/client"
)

// apiPass serves /ui/api/PATH as the control API's PATH, with the
// session's key and none of the browser's other headers but the body's
// type: the API decides what the key may do, and records it.
func (s *Server) apiPass(w http.ResponseWriter, r *http.Request) {
	path := strings.TrimPrefix(r.URL.Path, "/ui/api")
	if !strings.HasPrefix(path, "/") {
		writeError(w, http.StatusNotFound, "no such route")
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path, r2.URL.RawPath = path, strings.TrimPrefix(r.URL.RawPath, "/ui/api")
	r2.RequestURI = r2.URL.RequestURI()
	r2.Header = http.Header{}
	if ct := r.Header.Get("Content-Type"); ct != "" {
		r2.Header.Set("Content-Type", ct)
	}
	r2.Header.Set("X-API-Key", sessionOf(r).key)
	s.cfg.API.ServeHTTP(w, r2)
}

// apiError is an error answer of the API, passed on as it came.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

// failAPI answers with err's status when it is the API's, else 502.
func failAPI(w http.ResponseWriter, err error) {
	if ae, ok := err.(*apiError); ok {
		writeError(w, ae.status, ae.msg)
		return
	}
	writeError(w, http.StatusBadGateway, err.Error())
}

// recorder is a ResponseWriter that keeps the answer.
type recorder struct {
	h    http.Header
	code int
	buf  bytes.Buffer
}

func (rc *recorder) Header() http.Header         { return rc.h }
func (rc *recorder) Write(b []byte) (int, error) { return rc.buf.Write(b) }
func (rc *recorder) WriteHeader(code int) {
	if rc.code == 0 {
		rc.code = code
	}
}

// call makes one API call as the request's session (from the browser's
// address) and decodes a 2xx answer's JSON into out (nil: discarded).
func (s *Server) call(ctx context.Context, r *http.Request, method, path string, body any, out any) error {
	var rd io.Reader = http.NoBody
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, path, rd)
	if err != nil {
		return err
	}
	req.RemoteAddr = r.RemoteAddr
	req.Header.Set("X-API-Key", sessionOf(r).key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	rc := &recorder{h: http.Header{}}
	s.cfg.API.ServeHTTP(rc, req)
	if rc.code == 0 {
		rc.code = http.StatusOK
	}
	if rc.code/100 != 2 {
		var e errorJSON
		if json.Unmarshal(rc.buf.Bytes(), &e) != nil || e.Message == "" {
			e.Message = fmt.Sprintf("the API answered %d", rc.code)
		}
		return &apiError{status: rc.code, msg: e.Message}
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(rc.buf.Bytes(), out)
}

// agentOf is a client of a sandbox's agent through the daemon's proxy,
// with the access token the API gives the session's key (so a sandbox the
// key may not see is the API's 404).
func (s *Server) agentOf(r *http.Request, id string) (*agentclient.Client, *types.SandboxDetail, error) {
	var d types.SandboxDetail
	// Quiet: what the agent is then asked is in the trail (the proxy's
	// process and file entries); the lookup before it would only repeat it.
	if err := s.call(api.Quiet(r.Context()), r, http.MethodGet, "/sandboxes/"+url.PathEscape(id), nil, &d); err != nil {
		return nil, nil, err
	}
	if d.State != types.SandboxStateRunning {
		return nil, &d, &apiError{status: http.StatusConflict, msg: "the sandbox is " + string(d.State) + ": resume it first"}
	}
	c := client.New("", s.cfg.Proxy, "")
	c.HostSide = true // a browser that reads nothing holds little of the daemon's
	c.Dial = s.cfg.Dial
	ag, err := c.Agent(id, d.EnvdAccessToken)
	if err != nil {
		return nil, &d, err
	}
	return ag, &d, nil
}
