package ui

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"path"
	"sort"
	"strconv"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
)

// The file browser: a directory's entries (envd's ListDir), a file's
// bytes (envd's GET /files) and an upload (envd's POST /files), each
// through the proxy with the token the API gave the session's key, as the
// sandbox's default user.

// maxListed bounds the entries a listing returns.
const maxListed = 2000

type entry struct {
	Name     string    `json:"name"`
	Path     string    `json:"path"`
	Type     string    `json:"type"` // file, dir, symlink, other
	Size     int64     `json:"size"`
	Mode     string    `json:"mode"`
	Modified time.Time `json:"modified"`
	Target   string    `json:"target,omitempty"`
}

type listing struct {
	Path      string  `json:"path"`
	Entries   []entry `json:"entries"`
	Truncated bool    `json:"truncated,omitempty"`
}

func checkPath(w http.ResponseWriter, p string) bool {
	if p == "" || len(p) > 4096 {
		writeError(w, http.StatusBadRequest, "path: want 1 to 4096 bytes")
		return false
	}
	return true
}

// fileList lists a directory (path; default the user's home).
func (s *Server) fileList(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	if p == "" {
		p = "~"
	}
	if !checkPath(w, p) {
		return
	}
	ag, _, err := s.agentOf(r, r.PathValue("id"))
	if err != nil {
		failAPI(w, err)
		return
	}
	defer ag.Close()
	ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
	defer cancel()
	// The agent's first maxListed entries (in name order) are kept; the
	// rest of a large directory is counted and dropped as it arrives.
	l, err := ag.ListDir(ctx, connect.NewRequest(&fspb.ListDirRequest{Path: p, Depth: 1}), maxListed)
	if err != nil {
		writeError(w, connectStatus(err), "list "+p+": "+connect.CodeOf(err).String()+": "+errMessage(err))
		return
	}
	out := listing{Path: p, Entries: []entry{}, Truncated: l.Truncated}
	for _, e := range l.Entries {
		x := entry{Name: e.GetName(), Path: e.GetPath(), Size: e.GetSize(), Mode: e.GetPermissions(),
			Modified: e.GetModifiedTime().AsTime(), Target: e.GetSymlinkTarget()}
		switch e.GetType() {
		case fspb.FileType_FILE_TYPE_FILE:
			x.Type = "file"
		case fspb.FileType_FILE_TYPE_DIRECTORY:
			x.Type = "dir"
		default:
			x.Type = "other"
		}
		if x.Target != "" {
			x.Type = "symlink"
		}
		out.Entries = append(out.Entries, x)
	}
	if len(out.Entries) > 0 {
		out.Path = path.Dir(out.Entries[0].Path)
	}
	sort.Slice(out.Entries, func(i, j int) bool {
		a, b := out.Entries[i], out.Entries[j]
		if (a.Type == "dir") != (b.Type == "dir") {
			return a.Type == "dir"
		}
		return a.Name < b.Name
	})
	writeJSON(w, http.StatusOK, out)
}

func errMessage(err error) string {
	if ce, ok := err.(*connect.Error); ok {
		return ce.Message()
	}
	return err.Error()
}

func connectStatus(err error) int {
	switch connect.CodeOf(err) {
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeInvalidArgument, connect.CodeFailedPrecondition:
		return http.StatusBadRequest
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	}
	return http.StatusBadGateway
}

// fileDownload streams a file (path) as an attachment. It holds a
// connection through the proxy (from the loopback address, whose
// connections every tenant's dashboard shares) and a stream of the agent
// while it lasts: it counts against the session's live pages
// (holdStream), ends with the session (its key revoked, signed out), and
// ends when the browser takes no byte for downloadIdle. Found by review,
// 2026-12-04: downloads were unbounded in number, without a write
// deadline, and outlived their session.
func (s *Server) fileDownload(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	if !checkPath(w, p) {
		return
	}
	release, ok := holdStream(w, r)
	if !ok {
		return
	}
	defer release()
	ag, _, err := s.agentOf(r, r.PathValue("id"))
	if err != nil {
		failAPI(w, err)
		return
	}
	defer ag.Close()
	ctx, cancel := s.streamContext(r)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, agentclient.BaseURL+"/files?path="+url.QueryEscape(p), nil)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	resp, err := ag.HTTP.Do(req)
	if err != nil {
		writeError(w, http.StatusBadGateway, err.Error())
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		passAgentError(w, resp)
		return
	}
	// Always an attachment: a name FormatMediaType cannot write is left out.
	disposition := mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)})
	if disposition == "" {
		disposition = "attachment"
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", disposition)
	if resp.ContentLength >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	_, _ = io.Copy(&progressWriter{w: w, rc: http.NewResponseController(w)}, resp.Body)
}

// progressWriter moves the connection's write deadline downloadIdle
// ahead of each write: a download lasts as long as its client keeps
// taking bytes.
type progressWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (p *progressWriter) Write(b []byte) (int, error) {
	_ = p.rc.SetWriteDeadline(time.Now().Add(downloadIdle))
	return p.w.Write(b)
}

// passAgentError answers with the agent's status and message.
func passAgentError(w http.ResponseWriter, resp *http.Response) {
	var e struct {
		Message string `json:"message"`
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if json.Unmarshal(b, &e) != nil || e.Message == "" {
		e.Message = fmt.Sprintf("the agent answered %d", resp.StatusCode)
	}
	status := resp.StatusCode
	if status < 400 || status > 599 {
		status = http.StatusBadGateway
	}
	writeError(w, status, e.Message)
}

// fileUpload writes the body to path (the whole file). The body's length
// must be declared and at most MaxUpload: a larger one is refused before
// a byte of it is read. It counts against the session's live pages and
// ends with the session, as a download does.
func (s *Server) fileUpload(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Query().Get("path")
	if !checkPath(w, p) {
		return
	}
	switch {
	case r.ContentLength < 0:
		writeError(w, http.StatusLengthRequired, "an upload must declare its length (Content-Length)")
		return
	case r.ContentLength > s.cfg.MaxUpload:
		writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("file of %d bytes: uploads are at most %d bytes", r.ContentLength, s.cfg.MaxUpload))
		return
	}
	release, ok := holdStream(w, r) // as a download (above)
	if !ok {
		return
	}
	defer release()
	ag, _, err := s.agentOf(r, r.PathValue("id"))
	if err != nil {
		failAPI(w, err)
		return
	}
	defer ag.Close()
	ctx, cancel := s.streamContext(r)
	defer cancel()
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(10 * time.Minute))
	body := http.MaxBytesReader(w, r.Body, s.cfg.MaxUpload)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, agentclient.BaseURL+"/files?path="+url.QueryEscape(p), body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	req.ContentLength = r.ContentLength
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := ag.HTTP.Do(req)
	if err != nil {
		writeError(w, http.StatusBadGateway, err.Error())
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		passAgentError(w, resp)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"path": p, "size": r.ContentLength})
}

// downloadIdle ends a download whose client takes no byte for that long
// (a variable for the tests).
var downloadIdle = time.Minute
