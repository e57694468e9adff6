package audit

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
)

// Small helpers of the proxy's observer.

// rpcUser is the user an RPC acts as: E2B's Authorization: Basic
// base64("name:"), "" for the agent's default.
func rpcUser(r *http.Request) string {
	v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Basic ")
	if !ok {
		return ""
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v))
	if err != nil {
		return ""
	}
	name, _, _ := strings.Cut(string(b), ":")
	return name
}

func userOrDefault(u string) string {
	if u == "" {
		return "(default)"
	}
	return u
}

func clientAddr(r *http.Request) string {
	if h, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return h
	}
	return r.RemoteAddr
}

func callID() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// counter counts the bytes of a response body that pass.
type counter struct {
	rc io.ReadCloser
	n  int64
}

func (c *counter) Read(p []byte) (int, error) {
	n, err := c.rc.Read(p)
	c.n += int64(n)
	return n, err
}

func (c *counter) Close() error { return c.rc.Close() }

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
