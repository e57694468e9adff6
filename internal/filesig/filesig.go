// Package filesig signs and checks the signatures of E2B's file URLs: a
// /files request may carry, instead of the sandbox's access token, a
// signature over its path, operation ("read" or "write"), user and optional
// expiry, made with the token: "v1_" + unpadded base64 of
// sha256("path:op:user:token[:expiry]"). The agent checks it, and so does the
// proxy before it forwards a single byte of the body.
package filesig

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Errors Check returns; each is a 401 at the edge.
var (
	ErrMissing = errors.New("missing access token or signature")
	ErrInvalid = errors.New("invalid signature")
	ErrBadTime = errors.New("invalid signature expiration")
	ErrExpired = errors.New("signature has expired")
)

// Sign returns the signature of a file URL; expiry 0 is none.
func Sign(path, op, user, token string, expiry int64) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if expiry != 0 {
		raw += ":" + strconv.FormatInt(expiry, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

// Check verifies the signature in a /files query (path, username, signature,
// signature_expiration) for operation op, in constant time.
func Check(q url.Values, op, token string, now time.Time) error {
	sig := q.Get("signature")
	if sig == "" {
		return ErrMissing
	}
	var exp int64
	hasExp := q.Has("signature_expiration")
	if hasExp {
		var err error
		if exp, err = strconv.ParseInt(q.Get("signature_expiration"), 10, 64); err != nil || exp == 0 {
			return ErrBadTime
		}
	}
	want := Sign(q.Get("path"), op, q.Get("username"), token, exp)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) != 1 {
		return ErrInvalid
	}
	if hasExp && exp < now.Unix() {
		return ErrExpired
	}
	return nil
}

// Op is the operation a /files request signs: "read" for GET and HEAD,
// "write" for anything else.
func Op(method string) string {
	if method == "GET" || method == "HEAD" {
		return "read"
	}
	return "write"
}
