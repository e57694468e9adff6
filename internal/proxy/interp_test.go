package proxy

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// TestInterpToken: on the code interpreter's port, running code takes the
// sandbox's access token, the context routes the SDK calls without it pass,
// any other route is refused without it, and a wrong token is refused on
// every route. The refusals are the proxy's own 401 (nothing reaches the
// sandbox); what passes reaches the server on the port (the fake agent
// answers the port forward's CONNECT and then the request itself) without
// the token.
func TestInterpToken(t *testing.T) {
	a := newFakeAgent(t)
	var mu sync.Mutex
	var seen []string // "METHOD PATH token=..." of what reached the port
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodConnect {
			mu.Lock()
			seen = append(seen, r.Method+" "+r.URL.Path+" token="+strings.Join(r.Header["X-Access-Token"], ","))
			mu.Unlock()
		}
		w.WriteHeader(http.StatusOK)
	})
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	cases := []struct {
		method, path, token string
		sent                bool
		want                int
	}{
		{"POST", "/execute", "", false, 401},
		{"POST", "/execute", "wrong", true, 401},
		{"POST", "/execute", "", true, 401}, // an empty token is a wrong one
		{"POST", "/execute", "the-token", true, 200},
		{"POST", "/execute?source=ci", "", false, 401},
		{"POST", "//execute", "", false, 401},
		{"POST", "/contexts/../execute", "", false, 401},
		{"POST", "/contexts/x/../../execute", "", false, 401},
		{"GET", "/anything", "", false, 401},
		{"GET", "/health", "", false, 200},
		{"GET", "/contexts", "", false, 200},
		{"POST", "/contexts", "", false, 200},
		{"POST", "/contexts/3f2a/restart", "", false, 200},
		{"DELETE", "/contexts/3f2a", "", false, 200},
		{"DELETE", "/contexts/3f2a", "wrong", true, 401},
		{"GET", "/contexts/3f2a", "", false, 401},
		{"POST", "/contexts/3f2a/restart/x", "", false, 401},
		{"PUT", "/contexts", "", false, 401},
	}
	for _, c := range cases {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, strings.NewReader(`{"code":"1"}`))
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(InterpPort))
		req.Header.Set(TrafficHeader, "traffic")
		if c.sent {
			req.Header.Set("X-Access-Token", c.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s %s (token sent %v %q): %d, want %d", c.method, c.path, c.sent, c.token, resp.StatusCode, c.want)
		}
	}
	want := []string{"POST /execute token=", "GET /health token=", "GET /contexts token=", "POST /contexts token=",
		"POST /contexts/3f2a/restart token=", "DELETE /contexts/3f2a token="}
	if strings.Join(seen, "; ") != strings.Join(want, "; ") {
		t.Errorf("reached the port: %q\nwant (in order, no token): %q", seen, want)
	}
}

// TestSandboxNeverSeesCageHeaders: what the proxy routes and checks by
// (the sandbox id and port, the traffic token) and another node's
// signature on traffic it forwarded here in cluster mode never reach the
// server in the sandbox, on an exposed port as on the agent's, nor does
// the dashboard's session cookie (a browser sends it to the proxy's port
// of the dashboard's host too); the client's own headers and cookies do. A node signature seen by a sandbox could be
// replayed to the cluster's internal routes.
func TestSandboxNeverSeesCageHeaders(t *testing.T) {
	a := newFakeAgent(t)
	var mu sync.Mutex
	var seen []http.Header
	a.srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodConnect {
			mu.Lock()
			seen = append(seen, r.Header.Clone())
			mu.Unlock()
		}
		w.WriteHeader(http.StatusOK)
	})
	srv := httptest.NewServer(New(sandboxes{sb{a}}, "", nil))
	defer srv.Close()
	for _, port := range []int{8080, EnvdPort} {
		req, _ := http.NewRequest("GET", srv.URL+"/health", nil)
		req.Header.Set("E2b-Sandbox-Id", "sandbox1")
		req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(port))
		req.Header.Set(TrafficHeader, "traffic")
		req.Header.Set(NodeAuthHeader, "node=a,t=1796282761,sig=738399c9")
		req.Header.Set("X-Client-Own", "kept")
		req.Header.Add("Cookie", "a=1; cage_ui=s1; __Host-cage_ui=s2")
		req.Header.Add("Cookie", " cage_ui =s3;b=2")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("port %d: %d", port, resp.StatusCode)
		}
	}
	if len(seen) != 2 {
		t.Fatalf("%d requests reached the sandbox, want 2", len(seen))
	}
	for i, h := range seen {
		for _, k := range []string{"E2b-Sandbox-Id", "E2b-Sandbox-Port", TrafficHeader, NodeAuthHeader} {
			if v := h.Get(k); v != "" {
				t.Errorf("request %d: the sandbox saw %s: %q", i, k, v)
			}
		}
		if h.Get("X-Client-Own") != "kept" {
			t.Errorf("request %d: the client's own header was dropped", i)
		}
		if c := h.Values("Cookie"); len(c) != 1 || c[0] != "a=1; b=2" {
			t.Errorf("request %d: the sandbox saw cookies %q, want the client's own without the dashboard's", i, c)
		}
	}
}
