package apispec

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"

	"github.com/cagehq/cage/api"
)

// --- helpers ---------------------------------------------------------------

const sbID = "i7k2m9x4q1w8e5r3t6y0"

// raw is a body sent exactly as written (for non-JSON and malformed bodies).
type raw string

func body(t *testing.T, v any) []byte {
	t.Helper()
	switch v := v.(type) {
	case nil:
		return nil
	case raw:
		return []byte(v)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func request(method, target string, reqBody []byte) *http.Request {
	req := httptest.NewRequest(method, "http://127.0.0.1:3000"+target, bytes.NewReader(reqBody))
	req.Header.Set("X-API-Key", "e2b_"+strings.Repeat("0123456789abcdef", 3)[:40])
	if reqBody != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req
}

func jsonHeader(kv ...string) http.Header {
	h := http.Header{"Content-Type": {"application/json"}}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h
}

// exchange is one request and the response a server could give to it.
type exchange struct {
	name     string
	method   string
	target   string
	reqBody  any
	status   int
	header   http.Header
	respBody any
}

func (x exchange) validate(t *testing.T) (reqErr, respErr error) {
	t.Helper()
	rb := body(t, x.reqBody)
	req := request(x.method, x.target, rb)
	reqErr = ValidateRequest(req, rb)
	respErr = ValidateResponse(req, x.status, x.header, body(t, x.respBody))
	return reqErr, respErr
}

func apiError(code int, msg string) map[string]any {
	return map[string]any{"code": code, "message": msg}
}

// sandbox is a full Sandbox as cage answers a create or connect.
func sandbox() map[string]any {
	return map[string]any{
		"sandboxID":          sbID,
		"templateID":         "host",
		"alias":              "host",
		"clientID":           "cage",
		"envdVersion":        "0.2.0",
		"envdAccessToken":    "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c0b2d4f6e8a0c1e3f",
		"trafficAccessToken": nil,
		"domain":             "sandbox.localhost",
		"wall":               "process",
		"cpuCount":           0.5,
		"memoryMB":           512,
		"diskSizeMB":         256,
		"pids":               512,
	}
}

// listed is a ListedSandbox; started is encoded the way encoding/json
// encodes a time.Time.
func listed(id, state string) map[string]any {
	started := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.FixedZone("CET", 3600))
	return map[string]any{
		"sandboxID":   id,
		"templateID":  "host",
		"clientID":    "cage",
		"startedAt":   started,
		"endAt":       started.Add(5 * time.Minute).UTC(),
		"cpuCount":    1,
		"memoryMB":    512,
		"diskSizeMB":  256,
		"metadata":    map[string]string{"user": "abc", "app": "prod"},
		"state":       state,
		"envdVersion": "0.2.0",
		"wall":        "process",
		"pids":        512,
	}
}

func detail() map[string]any {
	d := listed(sbID, "running")
	d["envdAccessToken"] = "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c0b2d4f6e8a0c1e3f"
	d["domain"] = nil
	d["alias"] = "host"
	return d
}

func metric(unix int64) map[string]any {
	return map[string]any{
		"timestamp":     time.Unix(unix, 0).UTC().Format(time.RFC3339),
		"timestampUnix": unix,
		"cpuCount":      2,
		"cpuUsedPct":    12.5,
		"memUsed":       int64(100 << 20),
		"memTotal":      int64(512 << 20),
		"memCache":      int64(20 << 20),
		"diskUsed":      int64(1 << 20),
		"diskTotal":     int64(256 << 20),
	}
}

func without(m map[string]any, keys ...string) map[string]any {
	c := make(map[string]any, len(m))
	for k, v := range m {
		if !slices.Contains(keys, k) {
			c[k] = v
		}
	}
	return c
}

func with(m map[string]any, k string, v any) map[string]any {
	c := without(m)
	c[k] = v
	return c
}

// --- the document ------------------------------------------------------------

func TestDocLoadsAndValidates(t *testing.T) {
	doc, err := Doc()
	if err != nil {
		t.Fatal(err)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("doc.Validate: %v", err)
	}
	if !doc.IsOpenAPI30() {
		t.Errorf("openapi: %q, want 3.0.x", doc.OpenAPI)
	}
	again, _ := Doc()
	if again != doc {
		t.Error("Doc parsed the document twice")
	}

	// An independent parse of the file on disk gives the same document:
	// the embedded bytes are the file.
	onDisk, err := os.ReadFile("../../api/openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDisk, api.OpenAPI) {
		t.Fatal("api.OpenAPI differs from api/openapi.yaml (rebuild)")
	}
}

func TestSecurityDeclared(t *testing.T) {
	doc, err := Doc()
	if err != nil {
		t.Fatal(err)
	}
	ref := doc.Components.SecuritySchemes["ApiKeyAuth"]
	if ref == nil || ref.Value == nil {
		t.Fatal("no ApiKeyAuth security scheme")
	}
	if s := ref.Value; s.Type != "apiKey" || s.In != "header" || s.Name != "X-API-Key" {
		t.Errorf("ApiKeyAuth = %s in %s named %s, want apiKey in header named X-API-Key", s.Type, s.In, s.Name)
	}
	if len(doc.Security) != 1 || doc.Security[0]["ApiKeyAuth"] == nil {
		t.Errorf("global security = %v, want ApiKeyAuth", doc.Security)
	}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			public := op.Security != nil && len(*op.Security) == 0
			if public != (path == "/health") {
				t.Errorf("%s %s: public = %t; only /health needs no API key", method, path, public)
			}
		}
	}
}

// Every operation documents the errors it can give, each as a JSON Error.
func TestErrorsDocumented(t *testing.T) {
	doc, err := Doc()
	if err != nil {
		t.Fatal(err)
	}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			name := method + " " + path
			errRef := "#/components/schemas/Error"
			want := []string{"500"}
			switch {
			case strings.HasPrefix(path, "/volumecontent/"):
				// E2B's volume content API: its own error shape; every
				// operation names a path; a file's size is bounded by
				// its volume's (507), not by the request.
				errRef = "#/components/schemas/VolumeContentError"
				want = append(want, "401", "400", "404")
				if method == "PATCH" {
					want = append(want, "413")
				}
				if method == "PUT" || method == "POST" {
					want = append(want, "507")
				}
			case path != "/health":
				want = append(want, "401", "429")
				if op.RequestBody != nil {
					want = append(want, "400", "413")
				}
			}
			if strings.Contains(path, "{sandboxID}") || strings.Contains(path, "{volumeID}") {
				want = append(want, "404")
			}
			for _, code := range want {
				if op.Responses.Value(code) == nil {
					t.Errorf("%s: does not document %s", name, code)
				}
			}
			if op.Responses.Default() != nil {
				t.Errorf("%s: has a default response; document each status", name)
			}
			for code, resp := range op.Responses.Map() {
				if code[0] != '4' && code[0] != '5' {
					continue
				}
				mt := resp.Value.Content.Get("application/json")
				if mt == nil || mt.Schema == nil || mt.Schema.Ref != errRef {
					t.Errorf("%s %s: not an application/json Error", name, code)
				}
			}
		}
	}
}

// cage's additions say so: their descriptions start with "cage:".
func TestCageAdditionsMarked(t *testing.T) {
	doc, err := Doc()
	if err != nil {
		t.Fatal(err)
	}
	additions := map[string][]string{
		"NewSandbox":    {"wall", "cpuCount", "memoryMB", "diskSizeMB", "pids"},
		"NewSandboxV2":  {"wall", "cpuCount", "memoryMB", "diskSizeMB", "pids"},
		"Sandbox":       {"wall", "cpuCount", "memoryMB", "diskSizeMB", "pids"},
		"ListedSandbox": {"wall", "pids"},
		"SandboxDetail": {"wall", "pids"},
	}
	for schema, fields := range additions {
		s := doc.Components.Schemas[schema]
		if s == nil {
			t.Errorf("no schema %s", schema)
			continue
		}
		for _, f := range fields {
			p := s.Value.Properties[f]
			if p == nil {
				t.Errorf("%s has no %s", schema, f)
				continue
			}
			if !strings.HasPrefix(p.Value.Description, "cage:") {
				t.Errorf("%s.%s: description %q does not start with \"cage:\"", schema, f, p.Value.Description)
			}
		}
	}
	for _, s := range []string{"Health", "Pids", "Wall"} {
		if d := doc.Components.Schemas[s].Value.Description; !strings.HasPrefix(d, "cage:") {
			t.Errorf("%s: description %q does not start with \"cage:\"", s, d)
		}
	}
	if d := doc.Paths.Value("/health").Get.Description; !strings.HasPrefix(d, "cage:") {
		t.Errorf("GET /health: description %q does not start with \"cage:\"", d)
	}
}

// --- examples that must validate ---------------------------------------------

func TestExamplesValidate(t *testing.T) {
	fullCreate := map[string]any{
		"templateID":            "host",
		"timeout":               120,
		"metadata":              map[string]string{"user": "abc"},
		"envVars":               map[string]string{"LANG": "C.UTF-8"},
		"allow_internet_access": false,
		"network": map[string]any{
			"allowOut":           []string{"example.com", "10.0.0.0/8"},
			"denyOut":            []string{"0.0.0.0/0"},
			"allowPublicTraffic": false,
		},
		"autoPause":  false,
		"autoResume": map[string]any{"enabled": false},
		"wall":       "process",
		"cpuCount":   0.5,
		"memoryMB":   1024,
		"diskSizeMB": 512,
		"pids":       256,
	}
	v1Create := with(fullCreate, "secure", true)
	xs := []exchange{
		{name: "health", method: "GET", target: "/health",
			status: 200, header: jsonHeader(), respBody: map[string]any{"status": "ok"}},
		{name: "create v2, every field", method: "POST", target: "/v2/sandboxes", reqBody: fullCreate,
			status: 201, header: jsonHeader(), respBody: sandbox()},
		{name: "create v2, template only", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 201, header: jsonHeader(), respBody: with(sandbox(), "trafficAccessToken", "tok")},
		{name: "create v1 with secure", method: "POST", target: "/sandboxes", reqBody: v1Create,
			status: 201, header: jsonHeader(), respBody: sandbox()},
		{name: "create, unknown template", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "nope"},
			status: 404, header: jsonHeader(), respBody: apiError(404, "template nope not found")},
		{name: "create, limit too small", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host", "memoryMB": 8},
			status: 400, header: jsonHeader(), respBody: apiError(400, "memory 8 MiB is too small (at least 32 MiB)")},
		{name: "create, body too large", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 413, header: jsonHeader(), respBody: apiError(413, "request body too large")},
		{name: "create, no key", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 401, header: jsonHeader(), respBody: apiError(401, "invalid API key")},
		{name: "create, too many", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 429, header: jsonHeader("Retry-After", "3"), respBody: apiError(429, "too many sandboxes")},
		{name: "list v2, a page with more to come", method: "GET",
			target: "/v2/sandboxes?metadata=user%3Dabc%26app%3Dprod&state=running,paused&limit=2",
			status: 200, header: jsonHeader("X-Next-Token", "c2JfMDAwMg"),
			respBody: []any{listed(sbID, "running"), listed("p0a9s8d7f6g5h4j3k2l1", "paused")}},
		{name: "list v2, the last page", method: "GET", target: "/v2/sandboxes?nextToken=c2JfMDAwMg&limit=2",
			status: 200, header: jsonHeader(), respBody: []any{listed(sbID, "running")}},
		{name: "list v2, empty", method: "GET", target: "/v2/sandboxes?state=paused",
			status: 200, header: jsonHeader(), respBody: raw("[]")},
		{name: "list v2, bad nextToken", method: "GET", target: "/v2/sandboxes?nextToken=garbage",
			status: 400, header: jsonHeader(), respBody: apiError(400, "bad nextToken")},
		{name: "list v1", method: "GET", target: "/sandboxes?metadata=user%3Dabc",
			status: 200, header: jsonHeader(), respBody: []any{listed(sbID, "running")}},
		{name: "get", method: "GET", target: "/sandboxes/" + sbID,
			status: 200, header: jsonHeader(), respBody: detail()},
		{name: "get, not found", method: "GET", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: apiError(404, "sandbox gone not found")},
		{name: "kill", method: "DELETE", target: "/sandboxes/" + sbID,
			status: 204},
		{name: "kill, not found", method: "DELETE", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: apiError(404, "sandbox gone not found")},
		{name: "set timeout", method: "POST", target: "/sandboxes/" + sbID + "/timeout", reqBody: map[string]any{"timeout": 60},
			status: 204},
		{name: "set timeout, above the maximum", method: "POST", target: "/sandboxes/" + sbID + "/timeout", reqBody: map[string]any{"timeout": 999999},
			status: 400, header: jsonHeader(), respBody: apiError(400, "timeout above the maximum")},
		{name: "refresh", method: "POST", target: "/sandboxes/" + sbID + "/refreshes", reqBody: map[string]any{"duration": 30},
			status: 204},
		{name: "refresh, no body", method: "POST", target: "/sandboxes/" + sbID + "/refreshes",
			status: 204},
		{name: "connect v1, running", method: "POST", target: "/sandboxes/" + sbID + "/connect", reqBody: map[string]any{"timeout": 60},
			status: 200, header: jsonHeader(), respBody: sandbox()},
		{name: "connect v2, resumed", method: "POST", target: "/v2/sandboxes/" + sbID + "/connect", reqBody: map[string]any{"timeout": 60, "memory": true},
			status: 201, header: jsonHeader(), respBody: sandbox()},
		{name: "connect v2, no body", method: "POST", target: "/v2/sandboxes/" + sbID + "/connect",
			status: 200, header: jsonHeader(), respBody: sandbox()},
		{name: "connect v2, being killed", method: "POST", target: "/v2/sandboxes/" + sbID + "/connect", reqBody: map[string]any{},
			status: 409, header: jsonHeader(), respBody: apiError(409, "sandbox is being killed")},
		{name: "metrics", method: "GET", target: "/sandboxes/" + sbID + "/metrics?start=1772366400&end=1772366460",
			status: 200, header: jsonHeader("Content-Type", "application/json; charset=utf-8"),
			respBody: []any{metric(1772366400), metric(1772366405)}},
		{name: "metrics, none yet", method: "GET", target: "/sandboxes/" + sbID + "/metrics",
			status: 200, header: jsonHeader(), respBody: raw("[]")},
		{name: "server error", method: "GET", target: "/sandboxes/" + sbID + "/metrics",
			status: 500, header: jsonHeader(), respBody: apiError(500, "internal error")},
	}
	for _, x := range xs {
		t.Run(x.name, func(t *testing.T) {
			reqErr, respErr := x.validate(t)
			if reqErr != nil {
				t.Errorf("request: %v", reqErr)
			}
			if respErr != nil {
				t.Errorf("response: %v", respErr)
			}
		})
	}
}

// Routes match on method and path whatever the host.
func TestAnyHost(t *testing.T) {
	for _, target := range []string{"http://10.1.2.3:49999/health", "https://api.example.com/health", "/health"} {
		req := httptest.NewRequest("GET", target, nil)
		if err := ValidateResponse(req, 200, jsonHeader(), []byte(`{"status":"ok"}`)); err != nil {
			t.Errorf("%s: %v", target, err)
		}
	}
}

// --- examples that must not validate ------------------------------------------

func TestResponsesRejected(t *testing.T) {
	xs := []struct {
		exchange
		want string // in the error
	}{
		{exchange{name: "Sandbox without sandboxID", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 201, header: jsonHeader(), respBody: without(sandbox(), "sandboxID")}, `"sandboxID" is missing`},
		{exchange{name: "Sandbox without a cage field", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 201, header: jsonHeader(), respBody: without(sandbox(), "wall")}, `"wall" is missing`},
		{exchange{name: "Sandbox with a camel-cased ID", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 201, header: jsonHeader(), respBody: with(without(sandbox(), "sandboxID"), "sandboxId", sbID)}, `"sandboxID" is missing`},
		{exchange{name: "envdVersion not a version", method: "POST", target: "/v2/sandboxes", reqBody: map[string]any{"templateID": "host"},
			status: 201, header: jsonHeader(), respBody: with(sandbox(), "envdVersion", "latest")}, "/envdVersion"},
		{exchange{name: "state exploded", method: "GET", target: "/v2/sandboxes",
			status: 200, header: jsonHeader(), respBody: []any{listed(sbID, "exploded")}}, "/0/state"},
		{exchange{name: "startedAt not RFC 3339", method: "GET", target: "/v2/sandboxes",
			status: 200, header: jsonHeader(), respBody: []any{with(listed(sbID, "running"), "startedAt", "2026-03-01 12:00:00")}}, "/0/startedAt"},
		{exchange{name: "cpuCount zero", method: "GET", target: "/sandboxes",
			status: 200, header: jsonHeader(), respBody: []any{with(listed(sbID, "running"), "cpuCount", 0)}}, "/0/cpuCount"},
		{exchange{name: "list not an array", method: "GET", target: "/v2/sandboxes",
			status: 200, header: jsonHeader(), respBody: map[string]any{"sandboxes": []any{}}}, "array"},
		{exchange{name: "SandboxDetail without envdAccessToken", method: "GET", target: "/sandboxes/" + sbID,
			status: 200, header: jsonHeader(), respBody: without(detail(), "envdAccessToken")}, `"envdAccessToken" is missing`},
		{exchange{name: "metric without memCache", method: "GET", target: "/sandboxes/" + sbID + "/metrics",
			status: 200, header: jsonHeader(), respBody: []any{without(metric(1772366400), "memCache")}}, `"memCache" is missing`},
		{exchange{name: "non-JSON error body", method: "GET", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: raw("404 page not found\n")}, "not one JSON value"},
		{exchange{name: "trailing bytes after the JSON", method: "GET", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: raw(`{"code":404,"message":"gone"}{"code":404}`)}, "not one JSON value"},
		{exchange{name: "plain-text error labelled JSON", method: "DELETE", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: raw("sandbox not found")}, "not one JSON value"},
		{exchange{name: "empty error body", method: "DELETE", target: "/sandboxes/gone",
			status: 500, header: jsonHeader(), respBody: raw("")}, "not one JSON value"},
		{exchange{name: "error as text/plain", method: "GET", target: "/sandboxes/gone",
			status: 404, header: http.Header{"Content-Type": {"text/plain; charset=utf-8"}}, respBody: raw("404 page not found\n")}, "Content-Type"},
		{exchange{name: "error without message", method: "GET", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: map[string]any{"code": 404}}, `"message" is missing`},
		{exchange{name: "error code not the status", method: "GET", target: "/sandboxes/gone",
			status: 404, header: jsonHeader(), respBody: apiError(500, "not found")}, "must equal the HTTP status"},
		{exchange{name: "undocumented status 200 on kill", method: "DELETE", target: "/sandboxes/" + sbID,
			status: 200, header: jsonHeader(), respBody: map[string]any{}}, "status 200 is not documented"},
		{exchange{name: "undocumented status 404 on list", method: "GET", target: "/v2/sandboxes",
			status: 404, header: jsonHeader(), respBody: apiError(404, "not found")}, "status 404 is not documented"},
		{exchange{name: "undocumented status 201 on get", method: "GET", target: "/sandboxes/" + sbID,
			status: 201, header: jsonHeader(), respBody: detail()}, "status 201 is not documented"},
		{exchange{name: "204 with a body", method: "DELETE", target: "/sandboxes/" + sbID,
			status: 204, header: jsonHeader(), respBody: map[string]any{}}, "without a body"},
		{exchange{name: "Retry-After not seconds", method: "GET", target: "/v2/sandboxes",
			status: 429, header: jsonHeader("Retry-After", "soon"), respBody: apiError(429, "slow down")}, "Retry-After"},
		{exchange{name: "health says something else", method: "GET", target: "/health",
			status: 200, header: jsonHeader(), respBody: map[string]any{"status": "degraded"}}, "/status"},
	}
	for _, x := range xs {
		t.Run(x.name, func(t *testing.T) {
			_, err := x.validate(t)
			if err == nil {
				t.Fatal("response validated; want an error")
			}
			if !strings.Contains(err.Error(), x.want) {
				t.Errorf("error %q does not mention %q", err, x.want)
			}
			if !strings.Contains(err.Error(), x.method+" ") {
				t.Errorf("error %q does not name the route", err)
			}
			t.Log(err)
		})
	}
}

func TestRequestsRejected(t *testing.T) {
	xs := []struct {
		method, target string
		body           any
		want           string
	}{
		{"POST", "/v2/sandboxes", map[string]any{"timeout": 60}, `"templateID" is missing`},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "timeout": 0}, "/timeout"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "timeout": "60"}, "/timeout"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "wall": "vm"}, "/wall"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "cpuCount": 0}, "/cpuCount"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "memoryMB": 1.5}, "/memoryMB"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "metadata": map[string]any{"n": 1}}, "/metadata/n"},
		{"POST", "/v2/sandboxes", map[string]any{"templateID": "host", "autoResume": map[string]any{}}, `"enabled" is missing`},
		{"POST", "/v2/sandboxes", raw(`{"templateID":`), "body"},
		{"POST", "/v2/sandboxes", nil, "body"},
		{"POST", "/sandboxes/" + sbID + "/timeout", map[string]any{}, `"timeout" is missing`},
		{"POST", "/sandboxes/" + sbID + "/connect", map[string]any{}, `"timeout" is missing`},
		{"GET", "/v2/sandboxes?state=exploded", nil, `parameter "state"`},
		{"GET", "/v2/sandboxes?state=running&state=paused", nil, `parameter "state"`},
		{"GET", "/v2/sandboxes?limit=0", nil, `parameter "limit"`},
		{"GET", "/v2/sandboxes?limit=ten", nil, `parameter "limit"`},
		{"GET", "/sandboxes/" + sbID + "/metrics?start=yesterday", nil, `parameter "start"`},
		{"DELETE", "/sandboxes/" + sbID, map[string]any{"force": true}, "body"},
		{"PUT", "/sandboxes/" + sbID, nil, "no route"},
		{"GET", "/v3/sandboxes", nil, "no route"},
	}
	for _, x := range xs {
		t.Run(x.method+" "+x.target, func(t *testing.T) {
			b := body(t, x.body)
			err := ValidateRequest(request(x.method, x.target, b), b)
			if err == nil {
				t.Fatal("request validated; want an error")
			}
			if !strings.Contains(err.Error(), x.want) {
				t.Errorf("error %q does not mention %q", err, x.want)
			}
			t.Log(err)
		})
	}
}

// --- the E2B JS SDK (npm e2b 2.51.0) -----------------------------------------

// What the SDK sends, built as src/sandbox/sandboxApi.ts builds it (read from
// dist/index.mjs), and cage's answers, which must satisfy the SDK's generated
// types (dist/index.d.ts, components["schemas"]).
func TestE2BSDKPayloads(t *testing.T) {
	xs := []exchange{
		{
			// Sandbox.create('base', {timeoutMs: 600_000, metadata, envs,
			// allowInternetAccess: true, network: {...},
			// lifecycle: {onTimeout: 'pause', autoResume: true}}):
			// createSandbox() drops undefined fields and adds fields cage does
			// not describe (volumeMounts, autoPauseMemory).
			name: "Sandbox.create", method: "POST", target: "/v2/sandboxes",
			reqBody: raw(`{"templateID":"base","metadata":{"session":"s-42"},"envVars":{"FOO":"bar"},` +
				`"timeout":600,"allow_internet_access":true,` +
				`"network":{"allowOut":["api.openai.com","*.github.com"],"denyOut":["0.0.0.0/0"],"allowPublicTraffic":false,"maskRequestHost":"localhost:${PORT}"},` +
				`"autoPause":true,"autoResume":{"enabled":true},` +
				`"volumeMounts":[{"name":"data","path":"/mnt/data"}]}`),
			status: 201, header: jsonHeader(),
			// The SDK reads sandboxID, domain, envdVersion (>= 0.1.0),
			// envdAccessToken and trafficAccessToken.
			respBody: raw(`{"sandboxID":"` + sbID + `","templateID":"base","alias":"base","clientID":"cage",` +
				`"envdVersion":"0.4.2","envdAccessToken":"5c0ffee5c0ffee5c0ffee5c0ffee5c0ffee5c0ffee5c0ffe",` +
				`"trafficAccessToken":"1a2b3c","domain":null,` +
				`"wall":"process","cpuCount":1,"memoryMB":512,"diskSizeMB":256,"pids":512}`),
		},
		{
			// Sandbox.connect(id) with no options: {timeout: undefined,
			// memory: undefined} serialises to {}.
			name: "Sandbox.connect", method: "POST", target: "/v2/sandboxes/" + sbID + "/connect",
			reqBody: raw(`{}`),
			status:  201, header: jsonHeader(),
			respBody: raw(`{"sandboxID":"` + sbID + `","templateID":"base","clientID":"cage","envdVersion":"0.4.2",` +
				`"envdAccessToken":"5c0ffee5","trafficAccessToken":null,"domain":"cage.localhost",` +
				`"wall":"process","cpuCount":2,"memoryMB":2048,"diskSizeMB":1024,"pids":1024}`),
		},
		{
			// Sandbox.connect(id, {timeoutMs: 90_500, onResume: 'reboot'}).
			name: "Sandbox.connect reboot", method: "POST", target: "/v2/sandboxes/" + sbID + "/connect",
			reqBody: raw(`{"timeout":91,"memory":false}`),
			status:  404, header: jsonHeader(),
			// kill() and connect() test error.code === 404.
			respBody: raw(`{"code":404,"message":"sandbox ` + sbID + ` not found"}`),
		},
		{
			// Sandbox.list({query: {metadata: {user: 'a b'}, state: ['running',
			// 'paused']}, limit: 10}) — arrays as form, explode false; the
			// metadata pairs URL-encoded twice; the SDK also sends order,
			// template and startedAfter, which cage does not describe.
			name: "Sandbox.list", method: "GET",
			target: "/v2/sandboxes?metadata=user%3Da%2520b&state=running,paused&order=desc&limit=10",
			status: 200, header: jsonHeader("X-Next-Token", "MTc3MjM2NjQwMA"),
			respBody: raw(`[{"sandboxID":"` + sbID + `","templateID":"base","alias":"base","clientID":"cage",` +
				`"startedAt":"2026-03-01T12:00:00.5Z","endAt":"2026-03-01T12:10:00.5Z",` +
				`"cpuCount":1,"memoryMB":512,"diskSizeMB":256,"metadata":{"user":"a b"},"state":"paused",` +
				`"envdVersion":"0.4.2","wall":"process","pids":512}]`),
		},
		{
			// Sandbox.getInfo(id).
			name: "Sandbox.getInfo", method: "GET", target: "/sandboxes/" + sbID,
			status: 200, header: jsonHeader(),
			respBody: raw(`{"sandboxID":"` + sbID + `","templateID":"base","clientID":"cage",` +
				`"startedAt":"2026-03-01T12:00:00Z","endAt":"2026-03-01T12:05:00Z",` +
				`"cpuCount":1,"memoryMB":512,"diskSizeMB":256,"metadata":{},"state":"running",` +
				`"envdVersion":"0.4.2","envdAccessToken":"5c0ffee5","domain":null,"wall":"process","pids":512}`),
		},
		{
			// sandbox.setTimeout(30_001): Math.ceil to seconds.
			name: "Sandbox.setTimeout", method: "POST", target: "/sandboxes/" + sbID + "/timeout",
			reqBody: raw(`{"timeout":31}`), status: 204,
		},
		{
			// sandbox.getMetrics({start, end}): seconds, Math.round.
			name: "Sandbox.getMetrics", method: "GET", target: "/sandboxes/" + sbID + "/metrics?start=1772366400&end=1772366700",
			status: 200, header: jsonHeader(),
			respBody: raw(`[{"timestamp":"2026-03-01T12:00:00Z","timestampUnix":1772366400,"cpuCount":1,"cpuUsedPct":3.25,` +
				`"memUsed":41943040,"memTotal":536870912,"memCache":1048576,"diskUsed":4096,"diskTotal":268435456}]`),
		},
	}
	for _, x := range xs {
		t.Run(x.name, func(t *testing.T) {
			reqErr, respErr := x.validate(t)
			if reqErr != nil {
				t.Errorf("request: %v", reqErr)
			}
			if respErr != nil {
				t.Errorf("response: %v", respErr)
			}
		})
	}
}

// The fields the SDK's types require (index.d.ts: those without "?"), and
// the ones its code reads, are in cage's schemas, required where the SDK
// requires them.
func TestE2BSDKFields(t *testing.T) {
	doc, err := Doc()
	if err != nil {
		t.Fatal(err)
	}
	sdk := map[string]struct{ required, optional []string }{
		"Sandbox": {
			required: []string{"clientID", "envdVersion", "sandboxID", "templateID"},
			optional: []string{"alias", "domain", "envdAccessToken", "trafficAccessToken"},
		},
		"ListedSandbox": {
			required: []string{"clientID", "cpuCount", "diskSizeMB", "endAt", "envdVersion", "memoryMB", "sandboxID", "startedAt", "state", "templateID"},
			optional: []string{"alias", "metadata"},
		},
		"SandboxDetail": {
			required: []string{"clientID", "cpuCount", "diskSizeMB", "endAt", "envdVersion", "memoryMB", "sandboxID", "startedAt", "state", "templateID"},
			optional: []string{"alias", "domain", "envdAccessToken", "metadata"},
		},
		"SandboxMetric": {
			required: []string{"cpuCount", "cpuUsedPct", "diskTotal", "diskUsed", "memCache", "memTotal", "memUsed", "timestamp", "timestampUnix"},
		},
		"Error":                 {required: []string{"code", "message"}},
		"NewSandboxV2":          {required: []string{"templateID"}, optional: []string{"allow_internet_access", "autoPause", "autoResume", "envVars", "metadata", "network", "timeout"}},
		"NewSandbox":            {required: []string{"templateID"}, optional: []string{"allow_internet_access", "autoPause", "autoResume", "envVars", "metadata", "network", "secure", "timeout"}},
		"ConnectSandbox":        {required: []string{"timeout"}},
		"ConnectSandboxV2":      {optional: []string{"memory", "timeout"}},
		"SandboxTimeoutRequest": {required: []string{"timeout"}},
		"SandboxRefreshRequest": {optional: []string{"duration"}},
		"SandboxNetworkConfig":  {optional: []string{"allowOut", "allowPublicTraffic", "denyOut"}},
		"SandboxAutoResumeConfig": {
			required: []string{"enabled"},
		},
	}
	for name, want := range sdk {
		ref := doc.Components.Schemas[name]
		if ref == nil {
			t.Errorf("no schema %s (the SDK's name)", name)
			continue
		}
		s := ref.Value
		for _, f := range append(slices.Clone(want.required), want.optional...) {
			if s.Properties[f] == nil {
				t.Errorf("%s: no property %s", name, f)
			}
		}
		for _, f := range want.required {
			if !slices.Contains(s.Required, f) {
				t.Errorf("%s: %s is required by the SDK's types but not by cage's schema", name, f)
			}
		}
	}
	// Response fields the SDK may get as null.
	for _, f := range []string{"domain", "trafficAccessToken"} {
		if p := doc.Components.Schemas["Sandbox"].Value.Properties[f]; p == nil || !p.Value.Nullable {
			t.Errorf("Sandbox.%s: not nullable", f)
		}
	}
	// The SDK's state values.
	if got := doc.Components.Schemas["SandboxState"].Value.Enum; !slices.Equal(got, []any{"running", "paused"}) {
		t.Errorf("SandboxState enum = %v", got)
	}
	// The list header the SDK reads (response.headers.get("x-next-token")).
	h := doc.Paths.Value("/v2/sandboxes").Get.Responses.Status(200).Value.Headers
	if h["X-Next-Token"] == nil {
		t.Error("GET /v2/sandboxes 200 does not declare X-Next-Token")
	}
	// The SDK's querySerializer: arrays as form, explode false.
	for _, p := range doc.Paths.Value("/v2/sandboxes").Get.Parameters {
		if p.Value.Name == "state" {
			sm, err := p.Value.SerializationMethod()
			if err != nil || sm.Style != openapi3.SerializationForm || sm.Explode {
				t.Errorf("state: serialization %+v, %v; want form, explode false", sm, err)
			}
		}
	}
}
