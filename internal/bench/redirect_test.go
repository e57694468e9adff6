package bench

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cagehq/cage/api/types"
)

// Attack: the server on a bench sandbox's port 49999 (or its agent, for
// the desktop's screenshot) answers with a redirect to a service only the
// bench's machine reaches (cloud metadata, a loopback port). Expected:
// the redirect is not followed (the service sees neither the code nor the
// sandbox's tokens) and the run fails naming the answer.
func TestBenchFollowsNoRedirect(t *testing.T) {
	var reached atomic.Int64
	hostOnly := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{"type":"result","text":"2","is_main_result":true}` + "\n"))
	}))
	defer hostOnly.Close()
	for _, code := range []int{http.StatusTemporaryRedirect, http.StatusFound, http.StatusPermanentRedirect} {
		proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", hostOnly.URL+"/latest/meta-data/")
			w.WriteHeader(code)
		}))
		i := &interp{proxy: proxy.URL, sb: &types.Sandbox{SandboxID: "sbx1", EnvdAccessToken: "envd-token"}, http: sandboxHTTP(0)}
		_, err := i.run(context.Background(), "1+1")
		if err == nil || !strings.Contains(err.Error(), http.StatusText(code)) {
			t.Errorf("a %d from the sandbox: %v; want an error naming it", code, err)
		}
		proxy.Close()
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("the host-only service was reached %d times through the sandbox's redirects", n)
	}
}
