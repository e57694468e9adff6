// Package apispec holds cage's OpenAPI document (api/openapi.yaml, embedded) and checks
// requests and responses against it.
//
// Tests of the daemon call ValidateResponse on what the server answered and
// ValidateRequest on what they send, so that the document and the server
// cannot drift apart unnoticed:
//
//	resp, _ := http.DefaultClient.Do(req)
//	body, _ := io.ReadAll(resp.Body)
//	if err := apispec.ValidateResponse(req, resp.StatusCode, resp.Header, body); err != nil {
//		t.Error(err)
//	}
//
// Routes are matched on the request's method and path only (any host), and the
// API-key check the document declares is not performed: authentication is the
// server's business, the shapes are this package's.
package apispec

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"

	"github.com/cagehq/cage/api"
)

var (
	once    sync.Once
	doc     *openapi3.T
	router  routers.Router
	loadErr error
)

func load() {
	loader := openapi3.NewLoader()
	d, err := loader.LoadFromData(api.OpenAPI)
	if err != nil {
		loadErr = fmt.Errorf("apispec: parsing api/openapi.yaml: %w", err)
		return
	}
	if err := d.Validate(loader.Context); err != nil {
		loadErr = fmt.Errorf("apispec: api/openapi.yaml is not a valid OpenAPI document: %w", err)
		return
	}
	// Route on method and path alone: tests talk to servers on any address,
	// whatever the document's servers say.
	rd := *d
	rd.Servers = openapi3.Servers{{URL: "/"}}
	r, err := gorillamux.NewRouter(&rd)
	if err != nil {
		loadErr = fmt.Errorf("apispec: building the router: %w", err)
		return
	}
	doc, router = d, r
}

// Doc returns cage's OpenAPI document, parsed and validated once. The result
// is shared: callers must not modify it.
func Doc() (*openapi3.T, error) {
	once.Do(load)
	return doc, loadErr
}

// ValidateResponse checks a response (status, headers, JSON body) against the operation the
// request matches. It returns an error naming the route and what did not match.
// A status the operation does not document is an error, and so are a body on a
// response documented without one (204) and an error body whose code is not
// the status.
func ValidateResponse(req *http.Request, status int, header http.Header, body []byte) error {
	in, name, err := find(req)
	if err != nil {
		return err
	}
	op := in.Route.Operation
	resp := op.Responses.Status(status)
	if resp == nil {
		resp = op.Responses.Default()
	}
	if resp == nil || resp.Value == nil {
		return fmt.Errorf("%s: response status %d is not documented (documented: %s)", name, status, documented(op))
	}
	documentedBody := len(resp.Value.Content) > 0
	if header == nil {
		header = http.Header{}
	}
	out := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: in,
		Status:                 status,
		Header:                 header,
		Options:                in.Options,
	}
	out.SetBodyBytes(body)
	// kin-openapi decodes only the first JSON value of a body: "404 page not
	// found" would pass for the number 404, and trailing bytes go unseen.
	if documentedBody && isJSON(header.Get("Content-Type")) && !json.Valid(body) {
		return fmt.Errorf("%s: response %d: body is not one JSON value: %.80q", name, status, body)
	}
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		return fmt.Errorf("%s: response %d: %s", name, status, describe(err))
	}
	if !documentedBody && len(bytes.TrimSpace(body)) > 0 {
		return fmt.Errorf("%s: response %d: documented without a body, but has %d bytes: %.80q", name, status, len(body), body)
	}
	if status >= 400 {
		// The E2B SDKs branch on the body's code (error.code === 404), so it
		// must repeat the status.
		var e struct {
			Code *int `json:"code"`
		}
		if json.Unmarshal(body, &e) == nil && e.Code != nil && *e.Code != status {
			return fmt.Errorf("%s: response %d: error body has code %d; it must equal the HTTP status", name, status, *e.Code)
		}
	}
	return nil
}

// ValidateRequest likewise, for request bodies the tests send: it checks the
// request's path and query parameters, its Content-Type and body (given
// separately; req.Body is not read) against the operation it matches.
func ValidateRequest(req *http.Request, body []byte) error {
	in, name, err := find(req)
	if err != nil {
		return err
	}
	r := req.Clone(req.Context())
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	in.Request = r
	if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
		return fmt.Errorf("%s: request: %s", name, describe(err))
	}
	if err := repeatedQuery(in); err != nil {
		return fmt.Errorf("%s: request: %w", name, err)
	}
	return nil
}

// repeatedQuery rejects a query parameter given more than once unless it is
// an exploded array: kin-openapi quietly reads only the first of
// `state=running&state=paused`, where the document (and the E2B SDKs) have
// `state=running,paused`.
func repeatedQuery(in *openapi3filter.RequestValidationInput) error {
	q := in.Request.URL.Query()
	params := append(slices.Clone(in.Route.PathItem.Parameters), in.Route.Operation.Parameters...)
	for _, ref := range params {
		p := ref.Value
		if p == nil || p.In != openapi3.ParameterInQuery || len(q[p.Name]) < 2 {
			continue
		}
		sm, err := p.SerializationMethod()
		if err != nil {
			return err
		}
		array := p.Schema != nil && p.Schema.Value != nil && p.Schema.Value.Type.Is(openapi3.TypeArray)
		if !array || !sm.Explode {
			return fmt.Errorf("parameter %q in query: given %d times; send it once (style %s, explode %t: %s=a,b)",
				p.Name, len(q[p.Name]), sm.Style, sm.Explode, p.Name)
		}
	}
	return nil
}

func isJSON(contentType string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json"))
}

// find matches req to an operation and names it for error messages.
func find(req *http.Request) (*openapi3filter.RequestValidationInput, string, error) {
	if _, err := Doc(); err != nil {
		return nil, "", err
	}
	if req == nil || req.URL == nil {
		return nil, "", errors.New("apispec: no request to match a route")
	}
	route, params, err := router.FindRoute(req)
	if err != nil {
		return nil, "", fmt.Errorf("%s %s: no route in api/openapi.yaml: %w", req.Method, req.URL.Path, err)
	}
	name := req.Method + " " + route.Path
	if id := route.Operation.OperationID; id != "" {
		name += " (" + id + ")"
	}
	opts := &openapi3filter.Options{
		AuthenticationFunc:                openapi3filter.NoopAuthenticationFunc,
		IncludeResponseStatus:             true,
		RejectWhenRequestBodyNotSpecified: true,
		MultiError:                        true,
		SkipSettingDefaults:               true,
	}
	opts.WithCustomSchemaErrorFunc(schemaMessage)
	return &openapi3filter.RequestValidationInput{
		Request:    req,
		PathParams: params,
		Route:      route,
		Options:    opts,
	}, name, nil
}

// documented lists the statuses an operation documents, in order.
func documented(op *openapi3.Operation) string {
	var codes []string
	for code := range op.Responses.Map() {
		codes = append(codes, code)
	}
	slices.Sort(codes)
	return strings.Join(codes, ", ")
}

// describe flattens kin-openapi's nested and multiple errors into one line:
// each group (a parameter, the body) once, then what failed in it.
func describe(err error) string {
	return strings.Join(flatten(err), "; ")
}

func flatten(err error) []string {
	var me openapi3.MultiError
	if !errors.As(err, &me) || len(me) == 0 {
		return []string{err.Error()}
	}
	var lines []string
	for _, e := range me {
		lines = append(lines, flatten(e)...)
	}
	slices.Sort(lines)
	lines = slices.Compact(lines)
	prefix := ""
	switch e := err.(type) {
	case *openapi3filter.RequestError:
		prefix = requestPrefix(e)
	case *openapi3filter.ResponseError:
		prefix = e.Reason
	}
	if prefix == "" {
		return lines
	}
	return []string{prefix + ": " + strings.Join(lines, "; ")}
}

func requestPrefix(e *openapi3filter.RequestError) string {
	switch {
	case e.Parameter != nil:
		return fmt.Sprintf("parameter %q in %s", e.Parameter.Name, e.Parameter.In)
	case e.RequestBody != nil:
		return "body"
	}
	return e.Reason
}

// schemaMessage is a short form of a schema error: where, why, and the value
// (truncated), without the schema kin-openapi would print.
func schemaMessage(err *openapi3.SchemaError) string {
	where := "/" + strings.Join(err.JSONPointer(), "/")
	reason := err.Reason
	if reason == "" {
		reason = "does not match the schema's " + strconv.Quote(err.SchemaField)
	}
	if err.Origin != nil {
		reason = err.Origin.Error()
	}
	if err.SchemaField == "required" {
		return fmt.Sprintf("at %s: %s", where, reason)
	}
	v, _ := json.Marshal(err.Value)
	if len(v) > 120 {
		v = append(v[:117:117], "..."...)
	}
	return fmt.Sprintf("at %s: %s (value %s)", where, reason, v)
}
