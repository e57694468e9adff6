package kube

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestErrors: the API server's Status answers keep their reason and
// message through the client (wrapped too); an answer without a Status
// (a proxy's) is mapped by its code.
func TestErrors(t *testing.T) {
	answers := map[string]struct {
		code int
		body string
	}{
		"/api/v1/namespaces/n/pods/missing": {404, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \"missing\" not found","reason":"NotFound","code":404}`},
		"/api/v1/namespaces/n/pods/dup":     {409, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \"dup\" already exists","reason":"AlreadyExists","code":409}`},
		"/api/v1/namespaces/n/pods/stale":   {409, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Operation cannot be fulfilled on pods \"stale\": the object has been modified","reason":"Conflict","code":409}`},
		"/api/v1/namespaces/n/pods/old":     {410, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"too old resource version: 1 (200)","reason":"Expired","code":410}`},
		"/api/v1/namespaces/n/pods/secret":  {403, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \"secret\" is forbidden: User \"x\" cannot get resource","reason":"Forbidden","code":403}`},
		"/api/v1/namespaces/n/pods/proxy":   {404, "404 page not found\n"},
		"/api/v1/namespaces/n/pods/down":    {503, "<html>upstream down</html>"},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if got := r.Header.Get("Authorization"); got != "Bearer tok" {
			t.Errorf("authorization %q", got)
		}
		if got := r.Header.Get("User-Agent"); got != "cage/test" {
			t.Errorf("user agent %q", got)
		}
		a, ok := answers[r.URL.Path]
		if !ok {
			a.code, a.body = 500, "unexpected "+r.URL.Path
		}
		w.WriteHeader(a.code)
		fmt.Fprint(w, a.body)
	}))
	defer srv.Close()
	c, err := New(&Config{Server: srv.URL, Token: "tok"}, Options{UserAgent: "cage/test"})
	if err != nil {
		t.Fatal(err)
	}
	get := func(name string) error {
		_, err := c.CoreV1().Pods("n").Get(context.Background(), name, metav1.GetOptions{})
		return fmt.Errorf("wrapped: %w", err)
	}
	type check struct {
		name                             string
		notFound, exists, conflict, gone bool
		forbidden                        bool
		msg                              string
	}
	for _, ck := range []check{
		{name: "missing", notFound: true, msg: `pods "missing" not found`},
		{name: "dup", exists: true, msg: `already exists`},
		{name: "stale", conflict: true, msg: "the object has been modified"},
		{name: "old", gone: true, msg: "too old resource version"},
		{name: "secret", forbidden: true, msg: "cannot get resource"},
		{name: "proxy", notFound: true, msg: "404 page not found"},
		{name: "down", msg: "503"},
	} {
		err := get(ck.name)
		if IsNotFound(err) != ck.notFound || IsAlreadyExists(err) != ck.exists || IsConflict(err) != ck.conflict ||
			IsGone(err) != ck.gone || IsForbidden(err) != ck.forbidden || !strings.Contains(err.Error(), ck.msg) {
			t.Errorf("%s: %v: notFound %v exists %v conflict %v gone %v forbidden %v", ck.name, err,
				IsNotFound(err), IsAlreadyExists(err), IsConflict(err), IsGone(err), IsForbidden(err))
		}
	}
	if IsNotFound(nil) || IsConflict(fmt.Errorf("plain")) {
		t.Error("a nil or plain error taken for an API error")
	}
	if err := NewConflict("secrets", "s", fmt.Errorf("x")); !IsConflict(err) || IsAlreadyExists(err) {
		t.Errorf("NewConflict: %v", err)
	}
	if err := NewNotFound("pods", "p"); !IsNotFound(err) {
		t.Errorf("NewNotFound: %v", err)
	}
}

// TestRetryAfter: an answer that asks for the request again (429 with
// Retry-After, as priority and fairness sends) is retried after the wait,
// a write included; a 5xx with Retry-After is retried for a GET only; a
// name is escaped in the path.
func TestRetryAfter(t *testing.T) {
	var gets, posts int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case "GET":
			gets++
			if r.URL.EscapedPath() != "/api/v1/namespaces/n/secrets/a%2Fb" {
				t.Errorf("path %q", r.URL.EscapedPath())
			}
			if gets == 1 {
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusTooManyRequests)
				return
			}
			fmt.Fprint(w, `{"metadata":{"name":"a/b"}}`)
		case "POST":
			posts++
			w.Header().Set("Retry-After", "1")
			if posts == 1 {
				w.WriteHeader(http.StatusTooManyRequests)
				return
			}
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	c, err := New(&Config{Server: srv.URL}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.CoreV1().Secrets("n").Get(context.Background(), "a/b", metav1.GetOptions{})
	if err != nil || s.Name != "a/b" || gets != 2 {
		t.Fatalf("get: %v, %v after %d tries; want the second try's answer", s, err, gets)
	}
	_, err = c.CoreV1().Secrets("n").Create(context.Background(), &corev1.Secret{}, metav1.CreateOptions{})
	if err == nil || posts != 2 || !strings.Contains(err.Error(), "503") {
		t.Fatalf("create: %v after %d tries; want the 429 retried and the 503 not", err, posts)
	}
}
