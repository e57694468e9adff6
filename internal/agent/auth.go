package agent

import (
	"compress/gzip"
	"errors"
	"io"
	"net/http"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/api/gen/process/processconnect"
)

// The agent's front door. Anyone who can reach the agent (through the
// daemon's proxy, anyone on the network who knows a sandbox id) may send it
// anything, so the access token is checked before a single byte of a body
// is read, and what an authorized request may make the agent hold in memory
// is bounded, decompression included.
//
//   - GET /health: no token.
//   - /files: the token header or a signature (authorizeFiles), checked
//     before the body; uploads stream to disk.
//   - everything else, CONNECT (port forwards) included: the token header.
//
// Connect RPC messages are limited per message (connect's ReadMaxBytes,
// which bounds the decompressed size) and every request body but
// StreamInput's (a client stream of many messages) in total, compressed
// bytes included. gzip is the only compression accepted; its reader stops
// one byte past the limit, so a bomb costs no more than the limit to refuse
// (connect would otherwise inflate the rest to report its size).
const (
	// maxProcessMessage fits the largest request of process.Process: a
	// SendInput or StreamInput chunk of a command's stdin (the SDKs send a
	// whole string in one message), or a Start with its arguments and
	// environment (Linux allows about 2 MiB of those).
	maxProcessMessage = 16 << 20
	// maxFilesystemMessage fits any filesystem.Filesystem request: at most
	// two paths (PATH_MAX is 4096) and a few flags.
	maxFilesystemMessage = 64 << 10
	// DefaultMaxInflatedUpload bounds what one gzip-encoded /files upload
	// may decompress to; the sandbox's disk bounds every upload too.
	DefaultMaxInflatedUpload = 4 << 30
)

// bodySlack is what a request body may hold beyond its one message: the
// envelope, and gzip's overhead on incompressible data.
func bodySlack(limit int64) int64 { return 1<<10 + limit/64 }

// route checks the token, then sends CONNECT (a port forward) to
// serveForward and the rest to the mux, each body bounded.
func (s *Server) route(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/health" && (r.Method == http.MethodGet || r.Method == http.MethodHead):
	case r.URL.Path == "/files" && r.Method != http.MethodConnect:
		// authorizeFiles takes a signature instead of the token.
	case !s.tokenOK(r.Header):
		s.unauthorized(w, r)
		return
	case r.Method == http.MethodConnect:
		s.serveForward(w, r)
		return
	default:
		if limit := messageLimit(r.URL.Path); limit > 0 {
			r.Body = http.MaxBytesReader(w, r.Body, limit+bodySlack(limit))
		}
	}
	s.mux.ServeHTTP(w, r)
}

// messageLimit is the largest body a request to path may send in total
// (0: no total, per message only).
func messageLimit(path string) int64 {
	switch {
	case path == processconnect.ProcessStreamInputProcedure:
		return 0
	case path == "/cage/restore":
		return 0 // a sandbox's files, bounded by its disk as they are written
	case len(path) > len(processPrefix) && path[:len(processPrefix)] == processPrefix:
		return maxProcessMessage
	}
	return maxFilesystemMessage
}

const processPrefix = "/" + processconnect.ProcessName + "/"

var connectErrors = connect.NewErrorWriter()

// unauthorized answers 401 in the request's protocol (a Connect or gRPC
// error where the client speaks one), without reading the body.
func (s *Server) unauthorized(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodConnect && connectErrors.IsSupported(r) {
		_ = connectErrors.Write(w, r, errUnauthenticated)
		return
	}
	http.Error(w, "missing or invalid access token", http.StatusUnauthorized)
}

// compressMinBytes is the smallest message the agent compresses for a
// client that accepts gzip: below it gzip saves a few bytes at the cost of
// a compressor (about a megabyte to fault in for a fresh agent) and CPU
// charged to the sandbox.
const compressMinBytes = 4 << 10

// rpcOptions are the handler options of a service whose messages may
// decompress to at most limit bytes.
func rpcOptions(limit int) []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(limit),
		connect.WithCompressMinBytes(compressMinBytes),
		connect.WithCompression("gzip",
			func() connect.Decompressor { return &cappedGzip{max: int64(limit) + 1} },
			func() connect.Compressor { return gzip.NewWriter(io.Discard) }),
	}
}

// cappedGzip is a gzip reader that fails once it has produced max bytes.
type cappedGzip struct {
	zr   gzip.Reader
	ok   bool // zr was reset onto a valid stream
	max  int64
	left int64
}

var errMessageTooLarge = errors.New("decompressed message too large")

func (c *cappedGzip) Read(p []byte) (int, error) {
	if !c.ok {
		return 0, io.ErrUnexpectedEOF
	}
	if c.left <= 0 {
		return 0, errMessageTooLarge
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.zr.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *cappedGzip) Close() error {
	if !c.ok {
		return nil
	}
	return c.zr.Close()
}

func (c *cappedGzip) Reset(r io.Reader) error {
	c.left = c.max
	err := c.zr.Reset(r)
	c.ok = err == nil
	return err
}
