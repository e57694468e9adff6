package ui

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/api"
)

// buildPoll is how long one read of a build's log waits for output.
const buildPoll = 15 * time.Second

// buildEvents streams a template build's log ("log" events: its text,
// each with the log's offset after it as the event's id, so a browser
// that reconnects goes on where it was) and its end ("done": the build),
// read from the API's long poll as the session's key: a key that is not
// an admin key gets the API's 403 before the stream starts.
func (s *Server) buildEvents(w http.ResponseWriter, r *http.Request) {
	release, ok := holdStream(w, r)
	if !ok {
		return
	}
	defer release()
	base := "/admin/templates/builds/" + url.PathEscape(r.PathValue("id"))
	var first types.TemplateBuild
	if err := s.call(r.Context(), r, http.MethodGet, base, nil, &first); err != nil {
		failAPI(w, err)
		return
	}
	off, _ := strconv.ParseInt(r.Header.Get("Last-Event-ID"), 10, 64)
	off = max(off, 0)
	ev := startSSE(w)
	ctx, cancel := s.streamContext(r)
	defer cancel()
	ctx = api.Quiet(ctx) // reads of the log are not the key's doing
	for {
		if !s.alive(r) {
			_ = ev.send("expired", errorJSON{Code: http.StatusUnauthorized, Message: "session expired: sign in again"})
			return
		}
		var l types.TemplateBuildLog
		err := s.call(ctx, r, http.MethodGet, fmt.Sprintf("%s/log?offset=%d&wait=%d", base, off, int(buildPoll/time.Second)), nil, &l)
		if ctx.Err() != nil {
			sessionEnded(ctx, ev)
			return
		}
		if err != nil {
			_ = ev.send("error", errorJSON{Code: http.StatusBadGateway, Message: err.Error()})
			return
		}
		if l.Text != "" || l.Truncated {
			fmt.Fprintf(ev.w, "id: %d\n", l.Next)
			if ev.send("log", map[string]any{"text": l.Text, "truncated": l.Truncated}) != nil {
				return
			}
		} else if ev.comment() != nil {
			return
		}
		off = l.Next
		if l.State != types.TemplateBuildLogStateBuilding {
			var b types.TemplateBuild
			if err := s.call(ctx, r, http.MethodGet, base, nil, &b); err != nil {
				_ = ev.send("error", errorJSON{Code: http.StatusBadGateway, Message: err.Error()})
				return
			}
			b.Log = "" // the browser has it
			_ = ev.send("done", b)
			return
		}
	}
}
