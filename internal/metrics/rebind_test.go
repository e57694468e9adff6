package metrics

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestRebindingRefused: a metrics listener without a token is on loopback
// only, but a page in a browser on the host can rebind a name of its own
// to 127.0.0.1 and read what it serves, as the page's own origin. Expected:
// without a token, a request whose Host is a name other than localhost is
// refused (403) before anything is read; an IP literal or localhost (what a
// scraper on the host sends) is served; with a token, the token decides,
// whatever the Host.
func TestRebindingRefused(t *testing.T) {
	m := New()
	open, tokened := m.Handler(""), m.Handler("0123456789abcdef")
	for _, c := range []struct {
		h     http.Handler
		host  string
		token string
		want  int
	}{
		{open, "127.0.0.1:9464", "", http.StatusOK},
		{open, "127.0.0.1", "", http.StatusOK},
		{open, "[::1]:9464", "", http.StatusOK},
		{open, "localhost:9464", "", http.StatusOK},
		{open, "LOCALHOST", "", http.StatusOK},
		{open, "evil.example:9464", "", http.StatusForbidden},
		{open, "evil.example", "", http.StatusForbidden},
		{open, "127.0.0.1.evil.example:9464", "", http.StatusForbidden},
		{open, "metrics.localhost:9464", "", http.StatusForbidden},
		{open, "", "", http.StatusForbidden},
		{tokened, "evil.example:9464", "", http.StatusUnauthorized},
		{tokened, "prometheus.internal:9464", "0123456789abcdef", http.StatusOK},
	} {
		req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		req.Host = c.host
		if c.token != "" {
			req.Header.Set("Authorization", "Bearer "+c.token)
		}
		w := httptest.NewRecorder()
		c.h.ServeHTTP(w, req)
		if w.Code != c.want {
			t.Errorf("Host %q, token %v: %d, want %d (%s)", c.host, c.token != "", w.Code, c.want, w.Body.String())
		}
		if c.want == http.StatusForbidden && len(w.Body.String()) > 200 {
			t.Errorf("Host %q: the refusal carried %d bytes", c.host, w.Body.Len())
		}
	}
}
