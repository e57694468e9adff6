package dify

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
)

// runRequest is the body of POST /v1/sandbox/run. Fields Dify no longer
// sends (dependencies) are ignored; preload is ignored as dify-sandbox
// ignores it unless told otherwise.
type runRequest struct {
	Language      string `json:"language"`
	Code          string `json:"code"`
	Preload       string `json:"preload"`
	EnableNetwork bool   `json:"enable_network"`
}

func (r *runRequest) fromForm(v url.Values) error {
	r.Language, r.Code, r.Preload = v.Get("language"), v.Get("code"), v.Get("preload")
	if s := v.Get("enable_network"); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("enable_network %q: want true or false", s)
		}
		r.EnableNetwork = b
	}
	return nil
}

func (r *runRequest) check() error {
	switch {
	case r.Language == "":
		return errors.New("language is required")
	case r.Code == "":
		return errors.New("code is required")
	}
	return nil
}

// langRequest is the request of the dependency routes.
type langRequest struct {
	Language string `json:"language"`
}

func (r *langRequest) fromForm(v url.Values) error { r.Language = v.Get("language"); return nil }

func (r *langRequest) check() error {
	if r.Language == "" {
		return errors.New("language is required")
	}
	return nil
}

type bindable interface {
	fromForm(url.Values) error
	check() error
}

// bind reads a request as dify-sandbox (gin) does: a Content-Type of
// exactly application/json is JSON, and a malformed one is HTTP 400; with
// any other type a malformed request is HTTP 200 (the envelope says -400):
// JSON for application/json with parameters, form fields for
// application/x-www-form-urlencoded and multipart/form-data, else the
// query string. It returns the status to answer an error with. The body
// is bounded by max (413 beyond).
func bind(w http.ResponseWriter, r *http.Request, dst bindable, max int64) (int, error) {
	ct := r.Header.Get("Content-Type")
	fail := http.StatusOK
	if ct == "application/json" {
		fail = http.StatusBadRequest
	}
	r.Body = http.MaxBytesReader(w, r.Body, max)
	mt, _, _ := mime.ParseMediaType(ct)
	var err error
	switch mt {
	case "application/json":
		err = json.NewDecoder(r.Body).Decode(dst)
		if errors.Is(err, io.EOF) {
			err = errors.New("empty body: want a JSON object")
		} else if err != nil && !tooLarge(err) {
			err = fmt.Errorf("invalid JSON body: %v", err)
		}
	case "application/x-www-form-urlencoded":
		if err = r.ParseForm(); err == nil {
			err = dst.fromForm(r.Form)
		}
	case "multipart/form-data":
		var v url.Values
		if v, err = multipartValues(r); err == nil {
			err = dst.fromForm(v)
		}
	default:
		err = dst.fromForm(r.URL.Query())
	}
	if tooLarge(err) {
		return http.StatusRequestEntityTooLarge, fmt.Errorf("the request body is larger than %d bytes", max)
	}
	if err != nil {
		return fail, err
	}
	if err := dst.check(); err != nil {
		return fail, err
	}
	return 0, nil
}

func tooLarge(err error) bool {
	var mbe *http.MaxBytesError
	return errors.As(err, &mbe)
}

// maxParts bounds a multipart body's parts, as Go's own ReadForm (and so
// gin, which dify-sandbox binds with) does: Dify sends four fields.
const maxParts = 1000

// multipartValues reads a multipart form's fields (and the query's); file
// parts are read past, never kept. At most maxParts parts: 16 MiB of
// one-byte fields was 144,000 parts, 236 MiB allocated and a second of
// the daemon's CPU each, 26 MiB kept (found by review, 2026-12-04).
func multipartValues(r *http.Request) (url.Values, error) {
	mr, err := r.MultipartReader()
	if err != nil {
		return nil, fmt.Errorf("multipart body: %v", err)
	}
	v := url.Values{}
	for n := 0; ; n++ {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			for k, vs := range r.URL.Query() { // after the body's, as net/http merges them
				v[k] = append(v[k], vs...)
			}
			return v, nil
		}
		if err != nil {
			return nil, err
		}
		if n == maxParts {
			return nil, fmt.Errorf("multipart body: more than %d parts", maxParts)
		}
		if p.FileName() != "" {
			if _, err := io.Copy(io.Discard, p); err != nil {
				return nil, err
			}
			continue
		}
		b, err := io.ReadAll(p)
		if err != nil {
			return nil, err
		}
		v.Add(p.FormName(), string(b))
	}
}
