package manager

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/wall"
)

// agentAt is a sandbox whose agent listens at srv (h2c, as agents do).
type agentAt struct {
	wall.Sandbox
	srv *httptest.Server
}

func (a agentAt) Token() string { return "tok" }
func (a agentAt) Dial(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", strings.TrimPrefix(a.srv.URL, "http://"))
}

// hostileAgent starts an agent that answers every request with answer.
func hostileAgent(t *testing.T, answer http.HandlerFunc) agentAt {
	t.Helper()
	srv := httptest.NewUnstartedServer(answer)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(func() { srv.CloseClientConnections(); srv.Close() })
	return agentAt{srv: srv}
}

// finishes runs f and fails the test if it has not returned after d.
func finishes(t *testing.T, d time.Duration, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("still waiting on the agent after %v", d)
	}
}

// Attack: a sandbox's agent (inside the wall: the sandbox's to replace)
// answers a pause's archive a byte at a time, well within its size
// bound, and its owner keeps the pause's request open. The pause held
// the sandbox's transition lock all that while, so its end timer (which
// takes the lock to pause or kill it at its timeout) waited, and the
// sweep that removes a revoked key's sandboxes passed it by: it ran on
// past its timeout and its key's revocation for as long as the owner
// liked. Expected: the host gives the archive archiveTime(limit) and
// then fails the pause (409), its lock let go; nothing is left on disk.
func TestSaveFilesBoundedInTime(t *testing.T) {
	defer func(d time.Duration) { archiveBase = d }(archiveBase)
	archiveBase = 500 * time.Millisecond
	sb := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		for r.Context().Err() == nil {
			if _, err := w.Write([]byte{0}); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(20 * time.Millisecond)
		}
	})
	path := filepath.Join(t.TempDir(), "paused", "sb.tar")
	var err error
	finishes(t, 20*time.Second, func() {
		err = (&Manager{}).saveFilesUpTo(context.Background(), sb, 1<<20, path)
	})
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "did not hand over") {
		t.Errorf("a pause whose agent trickles its archive: %v, want a conflict saying the agent did not hand over its files", err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(path)); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}
}

// Attack: resuming a sandbox paused with its memory, without it, thaws
// the sandbox and has its agent kill its processes; an agent that never
// answers held the resume, and the sandbox's lock, while the sandbox ran
// thawed with its end timer stopped (the pause stopped it; the resume
// arms it after the kill), past its timeout and its key's revocation for
// as long as the request was kept open. Expected: the kill is given
// killWithin, then the resume goes on (the agent's word was never what
// ended the processes' claim: the timer is armed again).
func TestKillAllBoundedInTime(t *testing.T) {
	defer func(d time.Duration) { killWithin = d }(killWithin)
	killWithin = 300 * time.Millisecond
	sb := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	var err error
	finishes(t, 20*time.Second, func() { err = killProcesses(context.Background(), sb) })
	if err == nil {
		t.Error("an agent that never answers the kill: no error")
	}
}
