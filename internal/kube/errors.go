package kube

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// StatusError is an error answer of the API server: its Status (the
// reason callers test with IsNotFound and the like, and its message).
type StatusError struct {
	Status metav1.Status
}

func (e *StatusError) Error() string { return e.Status.Message }

// statusError makes the error of a non-2xx answer: the Status the API
// server sent, or one made from the code (a proxy's or a plain answer).
func statusError(code int, method string, body []byte) error {
	var st metav1.Status
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" {
		if st.Code == 0 {
			st.Code = int32(code)
		}
		if st.Message == "" {
			st.Message = fmt.Sprintf("the server answered %d (%s)", code, st.Reason)
		}
		return &StatusError{Status: st}
	}
	st = metav1.Status{Status: metav1.StatusFailure, Code: int32(code), Reason: reasonFor(code)}
	msg := strings.TrimSpace(string(body))
	if len(msg) > 200 {
		msg = msg[:200]
	}
	if msg == "" {
		msg = http.StatusText(code)
	}
	st.Message = fmt.Sprintf("the server answered %s %d: %s", method, code, msg)
	return &StatusError{Status: st}
}

// reasonFor is the reason of a code without a Status, as client-go gives it.
func reasonFor(code int) metav1.StatusReason {
	switch code {
	case http.StatusNotFound:
		return metav1.StatusReasonNotFound
	case http.StatusConflict:
		return metav1.StatusReasonConflict
	case http.StatusGone:
		return metav1.StatusReasonGone
	case http.StatusUnauthorized:
		return metav1.StatusReasonUnauthorized
	case http.StatusForbidden:
		return metav1.StatusReasonForbidden
	case http.StatusTooManyRequests:
		return metav1.StatusReasonTooManyRequests
	case http.StatusGatewayTimeout:
		return metav1.StatusReasonTimeout
	case http.StatusServiceUnavailable:
		return metav1.StatusReasonServiceUnavailable
	}
	return metav1.StatusReasonUnknown
}

// status returns the Status of an API error, or nil.
func status(err error) *metav1.Status {
	var se *StatusError
	if errors.As(err, &se) {
		return &se.Status
	}
	return nil
}

func is(err error, reason metav1.StatusReason, code int) bool {
	st := status(err)
	if st == nil {
		return false
	}
	if st.Reason == reason {
		return true
	}
	return (st.Reason == "" || st.Reason == metav1.StatusReasonUnknown) && int(st.Code) == code && code != 0
}

// IsNotFound says whether err is the API server's NotFound.
func IsNotFound(err error) bool { return is(err, metav1.StatusReasonNotFound, http.StatusNotFound) }

// IsAlreadyExists says whether err is the API server's AlreadyExists.
func IsAlreadyExists(err error) bool { return is(err, metav1.StatusReasonAlreadyExists, 0) }

// IsConflict says whether err is a conflicting write (a stale
// resourceVersion, a failed precondition).
func IsConflict(err error) bool { return is(err, metav1.StatusReasonConflict, http.StatusConflict) }

// IsGone says whether err is a resourceVersion too old to watch from
// (410: Gone or Expired): the watcher must list again.
func IsGone(err error) bool {
	return is(err, metav1.StatusReasonGone, http.StatusGone) || is(err, metav1.StatusReasonExpired, http.StatusGone)
}

// IsForbidden says whether err is the API server's Forbidden.
func IsForbidden(err error) bool { return is(err, metav1.StatusReasonForbidden, http.StatusForbidden) }

// NewConflict is a Conflict error about the named object (for a caller
// that retries on conflict).
func NewConflict(resource, name string, err error) *StatusError {
	return &StatusError{Status: metav1.Status{Status: metav1.StatusFailure, Code: http.StatusConflict,
		Reason:  metav1.StatusReasonConflict,
		Message: fmt.Sprintf("Operation cannot be fulfilled on %s %q: %v", resource, name, err)}}
}

// NewNotFound is a NotFound error about the named object (a cache's miss).
func NewNotFound(resource, name string) *StatusError {
	return &StatusError{Status: metav1.Status{Status: metav1.StatusFailure, Code: http.StatusNotFound,
		Reason: metav1.StatusReasonNotFound, Message: fmt.Sprintf("%s %q not found", resource, name)}}
}
