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
// A status the operation does not document is an error, and so is a body on a
// response documented without one (204).
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
	if resp == nil {
		return fmt.Errorf("%s: response status %d is not documented (documented: %s)", name, status, documented(op))
	}
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
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		return fmt.Errorf("%s: response %d: %s", name, status, describe(err))
	}
	if resp.Value != nil && len(resp.Value.Content) == 0 && len(bytes.TrimSpace(body)) > 0 {
		return fmt.Errorf("%s: response %d: documented without a body, but has %d bytes: %.80q", name, status, len(body), body)
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
	return nil
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
		AuthenticationFunc:    openapi3filter.NoopAuthenticationFunc,
		IncludeResponseStatus: true,
		MultiError:            true,
		SkipSettingDefaults:   true,
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

// describe flattens kin-openapi's nested and multiple errors into one line per
// failure.
func describe(err error) string {
	var lines []string
	var walk func(error)
	walk = func(err error) {
		var me openapi3.MultiError
		if errors.As(err, &me) && len(me) > 0 {
			prefix := ""
			switch e := err.(type) {
			case *openapi3filter.RequestError:
				prefix = requestPrefix(e)
			case *openapi3filter.ResponseError:
				if e.Reason != "" {
					prefix = e.Reason + ": "
				}
			}
			for _, e := range me {
				n := len(lines)
				walk(e)
				for i := n; i < len(lines); i++ {
					lines[i] = prefix + lines[i]
				}
			}
			return
		}
		lines = append(lines, err.Error())
	}
	walk(err)
	slices.Sort(lines)
	lines = slices.Compact(lines)
	return strings.Join(lines, "; ")
}

func requestPrefix(e *openapi3filter.RequestError) string {
	switch {
	case e.Parameter != nil:
		return fmt.Sprintf("parameter %q in %s: ", e.Parameter.Name, e.Parameter.In)
	case e.RequestBody != nil:
		return "body: "
	case e.Reason != "":
		return e.Reason + ": "
	}
	return ""
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
	v, _ := json.Marshal(err.Value)
	if len(v) > 120 {
		v = append(v[:117:117], "..."...)
	}
	return fmt.Sprintf("at %s: %s (value %s)", where, reason, v)
}
