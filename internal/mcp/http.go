package mcp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// MaxHTTPBody bounds a request body on /mcp: a file_write of maxWriteBytes
// in base64 and its envelope.
const MaxHTTPBody = 8 << 20

// HTTPConfig configures the streamable HTTP endpoint.
type HTTPConfig struct {
	// Verify checks an API key and returns its id: "" for one the daemon
	// never issued (or revoked); err for a failure to tell.
	Verify func(key string) (id string, err error)
	// Record, when set, is told of every answered request: the key's id
	// ("" when refused) and the status.
	Record func(r *http.Request, keyID string, status int)
	// Admit, when set, takes one of the key's request tokens (the API's
	// rate, as for any request the key makes) before the body is read, or
	// answers (429) and returns false.
	Admit func(w http.ResponseWriter, r *http.Request, keyID string) bool
	// Server is the server configuration for one request made with a key
	// Verify accepted (its Client carries that key).
	Server func(r *http.Request, key string) Config
	Log    *slog.Logger
}

type serverKey struct{}

// Handler serves MCP's streamable HTTP transport, statelessly (no session
// outlives its request: state lives in the sandboxes), with JSON answers.
// The key is checked before a byte of the body is read; a request that
// carries a credential in its URL is refused whatever else it carries.
func Handler(cfg HTTPConfig) http.Handler {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	servers := &serverCache{m: map[[32]byte]*sdk.Server{}}
	schemas, agents := sdk.NewSchemaCache(), NewAgents()
	h := sdk.NewStreamableHTTPHandler(func(r *http.Request) *sdk.Server {
		s, _ := r.Context().Value(serverKey{}).(*sdk.Server)
		return s
	}, &sdk.StreamableHTTPOptions{
		Stateless:    true,
		JSONResponse: true,
		// The API key guards every request, so a page that rebinds a name
		// to loopback gets nowhere; a reverse proxy in front of the
		// daemon's loopback listener keeps working.
		DisableLocalhostProtection: true,
		MaxRequestBodyBytes:        MaxHTTPBody,
		Logger:                     cfg.Log,
	})
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w := &statusWriter{ResponseWriter: rw}
		var keyID string
		if cfg.Record != nil {
			defer func() {
				status := w.status
				if status == 0 {
					status = http.StatusOK
				}
				cfg.Record(r, keyID, status)
			}()
		}
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				cfg.Log.Error("panic in /mcp", "panic", fmt.Sprint(v))
				httpError(w, http.StatusInternalServerError, "internal error")
			}
		}()
		key, id := cfg.authorize(w, r)
		if id == "" {
			return
		}
		keyID = id
		if cfg.Admit != nil && !cfg.Admit(w, r, id) {
			return
		}
		if r.Method == http.MethodPost {
			batch, err := peekBatch(r)
			if err != nil {
				httpError(w, http.StatusBadRequest, "reading the request: "+err.Error())
				return
			}
			if batch {
				httpError(w, http.StatusBadRequest, "JSON-RPC batches are not served (MCP 2025-06-18 dropped them): send one message a request")
				return
			}
		}
		if !inFlight.take(id) {
			httpError(w, http.StatusTooManyRequests, fmt.Sprintf("this key has %d requests on /mcp in flight, the most it may: wait for one to end", maxInFlightPerKey))
			return
		}
		defer inFlight.give(id)
		if r.Method == http.MethodPost {
			if status, msg := boundValues(w, r); status != 0 {
				httpError(w, status, msg)
				return
			}
		}
		sc := cfg.Server(r, key)
		sc.Schemas, sc.Agents = schemas, agents
		ctx := context.WithValue(r.Context(), serverKey{}, servers.get(sc))
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}

// What one request may make the daemon hold is bounded by its one call
// (a tool's answer is bounded): a JSON-RPC batch of many calls had every
// answer built in memory before any was written (one request of 7 KB
// with 48 file reads: 100 MB of answer, 389 MiB of heap), so batches are
// refused; and a key has at most maxInFlightPerKey requests in flight.
const maxInFlightPerKey = 16

var inFlight = &keyCounts{m: map[string]int{}}

type keyCounts struct {
	mu sync.Mutex
	m  map[string]int
}

func (k *keyCounts) take(id string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m[id] >= maxInFlightPerKey {
		return false
	}
	k.m[id]++
	return true
}

func (k *keyCounts) give(id string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m[id]--; k.m[id] <= 0 {
		delete(k.m, id)
	}
}

// maxJSONValues bounds the values (scalars, arrays, objects, an object's
// members) of one request's message. The SDK checks a tool's arguments
// against its schema by decoding them into Go maps and slices first, some
// 100 bytes of the daemon's heap for every 3 bytes of `{},` (found by
// review, 2026-12-04: one request of 8 MiB allocated some 450 MB, and a
// key has 16 in flight); an honest call holds a few hundred (envs and
// metadata are at most 256 each), a file's content is one string.
const maxJSONValues = 16 << 10

// boundValues reads the body (at most MaxHTTPBody) and counts the JSON
// values in it, for the SDK to read again: the status and message to
// refuse it with, or 0.
func boundValues(w http.ResponseWriter, r *http.Request) (int, string) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxHTTPBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return http.StatusRequestEntityTooLarge, fmt.Sprintf("the request body is larger than %d bytes", MaxHTTPBody)
		}
		return http.StatusBadRequest, "reading the request: " + err.Error()
	}
	if n := jsonValues(body, maxJSONValues); n > maxJSONValues {
		return http.StatusBadRequest, fmt.Sprintf("the message holds more than %d JSON values: send fewer arguments", maxJSONValues)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	return 0, ""
}

// jsonValues counts, up to past max, the values of a JSON text by its
// separators outside strings: each array and object opened, and each
// comma (one more element or member). It checks nothing else: the SDK
// parses what it lets through.
func jsonValues(b []byte, max int) int {
	n, inString, escaped := 0, false, false
	for _, c := range b {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '[' || c == '{' || c == ',':
			if n++; n > max {
				return n
			}
		}
	}
	return n
}

// peekBatch says whether the body is a JSON array (a batch), reading only
// the white space before its first byte and leaving the body whole.
func peekBatch(r *http.Request) (bool, error) {
	br := bufio.NewReader(r.Body)
	var head []byte
	for {
		c, err := br.ReadByte()
		if err == io.EOF {
			break
		}
		if err != nil {
			return false, err
		}
		head = append(head, c)
		if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			break
		}
		if len(head) > 4096 {
			return false, errors.New("more than 4 KiB of white space before the message")
		}
	}
	r.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(head), br), r.Body}
	return len(head) > 0 && head[len(head)-1] == '[', nil
}

// serverCache keeps a server per key (and addresses): making one costs
// about a millisecond (the SDK checks every tool's schema), once per key
// instead of once per request. A server holds its key's client, so it is
// reached only by requests whose key was verified to be that key.
type serverCache struct {
	mu sync.Mutex
	m  map[[32]byte]*sdk.Server
}

// maxServers bounds the servers kept (a daemon has a few keys).
const maxServers = 64

func (c *serverCache) get(sc Config) *sdk.Server {
	id := sha256.Sum256([]byte(strings.Join([]string{sc.Client.Key, sc.Client.API, sc.Client.Proxy, sc.ProxyURL}, "\x00")))
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.m[id]; ok {
		return s
	}
	if len(c.m) >= maxServers {
		clear(c.m)
	}
	s := NewServer(sc)
	c.m[id] = s
	return s
}

// authorize answers a request that carries a credential in its URL, or
// no key, or a key the daemon does not have, and returns the key and its
// id otherwise; it reads nothing of the body.
func (cfg HTTPConfig) authorize(w http.ResponseWriter, r *http.Request) (key, id string) {
	if name := credentialInURL(r); name != "" {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("refused: the URL carries a credential (%s); send the API key in the Authorization: Bearer or X-API-Key header, never in a URL (it ends up in logs)", name))
		return "", ""
	}
	key, msg := requestKey(r)
	if msg != "" {
		w.Header().Set("WWW-Authenticate", `Bearer realm="cage"`)
		httpError(w, http.StatusUnauthorized, msg)
		return "", ""
	}
	id, err := cfg.Verify(key)
	if err != nil {
		cfg.Log.Error("/mcp: verify key", "err", err)
		httpError(w, http.StatusInternalServerError, "internal error (the server's log has the detail)")
		return "", ""
	}
	if id == "" {
		w.Header().Set("WWW-Authenticate", `Bearer realm="cage", error="invalid_token"`)
		httpError(w, http.StatusUnauthorized, "invalid API key")
	}
	return key, id
}

// requestKey is the key a request carries, or why it carries none.
func requestKey(r *http.Request) (key, msg string) {
	xkey := r.Header.Get("X-API-Key")
	var bearer string
	if a := r.Header.Get("Authorization"); a != "" {
		scheme, rest, _ := strings.Cut(a, " ")
		if !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(rest) == "" {
			return "", "Authorization: want Bearer <API key>"
		}
		bearer = strings.TrimSpace(rest)
	}
	switch {
	case xkey == "" && bearer == "":
		return "", "missing API key: send it as Authorization: Bearer <key> or in the X-API-Key header"
	case xkey != "" && bearer != "" && xkey != bearer:
		return "", "two different API keys (Authorization and X-API-Key): send one"
	case xkey != "":
		return xkey, ""
	}
	return bearer, ""
}

// credentialInURL names a query parameter that looks like a credential.
func credentialInURL(r *http.Request) string {
	for name, vals := range r.URL.Query() {
		n := strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(name))
		switch n {
		case "key", "apikey", "xapikey", "token", "accesstoken", "authorization", "auth", "bearer", "e2bapikey", "cageapikey":
			return name
		}
		for _, v := range vals {
			if strings.HasPrefix(v, "e2b_") {
				return name
			}
		}
	}
	return ""
}

// statusWriter remembers the status of an answer; Flush and Unwrap keep
// what the SDK's handler asks of a ResponseWriter.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func httpError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": status, "message": msg})
}
