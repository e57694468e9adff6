package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/partbound"
)

// An upload (POST /files) is hashed as it passes to the agent: the body is
// forwarded as it comes, and a copy of each chunk goes through a pipe to a
// parser that reads it as the agent will (octet-stream or multipart) and
// hashes each file; a compressed upload is hashed as sent. The forwarding waits for the parser (it
// hashes faster than a network delivers); a parser that fails stops
// receiving copies and the upload goes on.

const (
	// maxUploadFiles bounds the files of one upload the trail lists (the
	// agent's own bound).
	maxUploadFiles = 10000
	// maxListedBytes bounds what the list of an upload's files holds
	// (their paths, and listedEntryCost each) until the upload ends; the
	// files past it are counted, not listed. Found by review, 2026-12-04:
	// 10,000 files of 4 KB paths were some 45 MiB of the daemon, held for
	// as long as the upload's client held the rest of its body back.
	maxListedBytes  = 1 << 20
	listedEntryCost = 256
	// parseWait is how long the end of a request waits for its parser.
	parseWait = 5 * time.Second
)

// uploadTee is an upload's body, copied to the parser.
type uploadTee struct {
	rc     io.ReadCloser
	pw     *io.PipeWriter
	result chan []map[string]any

	mu   sync.Mutex
	dead bool // the parser is gone: no more copies
	eof  bool // the whole body passed
}

func newUploadTee(r *http.Request) *uploadTee {
	pr, pw := io.Pipe()
	u := &uploadTee{rc: r.Body, pw: pw, result: make(chan []map[string]any, 1)}
	ctype, cenc, q := r.Header.Get("Content-Type"), r.Header.Get("Content-Encoding"), r.URL.Query()
	go func() {
		files := parseUpload(pr, ctype, cenc, q)
		_, _ = io.Copy(io.Discard, pr) // whatever follows (an epilogue) must not hold the upload
		pr.Close()
		u.result <- files
	}()
	r.Body = u
	return u
}

func (u *uploadTee) Read(p []byte) (int, error) {
	n, err := u.rc.Read(p)
	u.mu.Lock()
	dead := u.dead
	u.mu.Unlock()
	if n > 0 && !dead {
		if _, werr := u.pw.Write(p[:n]); werr != nil {
			u.mu.Lock()
			u.dead = true
			u.mu.Unlock()
		}
	}
	if errors.Is(err, io.EOF) {
		u.mu.Lock()
		u.eof = true
		u.mu.Unlock()
		u.pw.Close()
	}
	return n, err
}

func (u *uploadTee) Close() error { return u.rc.Close() }

// finish ends the parser's input and returns what it found: one detail per
// file ("complete": false when the agent did not read the whole body).
func (u *uploadTee) finish() []map[string]any {
	u.mu.Lock()
	eof := u.eof
	u.mu.Unlock()
	if !eof {
		u.pw.CloseWithError(io.ErrUnexpectedEOF)
	}
	var files []map[string]any
	select {
	case files = <-u.result:
	case <-time.After(parseWait):
		return []map[string]any{{"undecoded": "the upload's parser did not finish"}}
	}
	if !eof {
		for _, f := range files {
			f["complete"] = false
		}
	}
	return files
}

// parseUpload reads an upload as the agent does and hashes its files. It
// returns what it found up to the first error (with the error noted).
func parseUpload(r io.Reader, ctype, cenc string, q url.Values) []map[string]any {
	body := r
	if enc := strings.ToLower(strings.TrimSpace(cenc)); enc != "" && enc != "identity" {
		// The host does not inflate a tenant's compressed upload (a
		// bomb would cost the host what it costs the sandbox): it hashes
		// the bytes as sent.
		f := map[string]any{"path": q.Get("path"), "encoding": enc}
		hashInto(f, body)
		f["sent_size"], f["sent_sha256"] = f["size"], f["sha256"]
		delete(f, "size")
		delete(f, "sha256")
		return []map[string]any{f}
	}
	media, params, _ := mime.ParseMediaType(ctype)
	switch {
	case media == "application/octet-stream":
		f := map[string]any{"path": q.Get("path")}
		hashInto(f, body)
		return []map[string]any{f}
	case strings.HasPrefix(media, "multipart/") && params["boundary"] != "":
	default:
		return []map[string]any{{"path": q.Get("path"), "undecoded": "content type " + media}}
	}
	var files []map[string]any
	listed := 0 // bytes the list holds, about
	mr := partbound.NewReader(body, params["boundary"])
	more := 0
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			files = append(files, map[string]any{"undecoded": "multipart: " + err.Error()})
			break
		}
		p := q.Get("path")
		if !q.Has("path") {
			_, ps, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			p = ps["filename"] // the full path, as the agent reads it
		}
		if part.FormName() != "file" || len(files) >= maxUploadFiles || listed+len(p) > maxListedBytes {
			if part.FormName() == "file" {
				more++
			}
			if _, err := io.Copy(io.Discard, part); err != nil { // read past, unbounded, never kept
				break
			}
			continue
		}
		listed += len(p) + listedEntryCost
		f := map[string]any{"path": p}
		hashInto(f, part)
		files = append(files, f)
	}
	if more > 0 {
		files = append(files, map[string]any{"undecoded": itoa(int64(more)) + " more files in the upload are not listed"})
	}
	return files
}

// hashInto adds the size and SHA-256 of what r holds to f.
func hashInto(f map[string]any, r io.Reader) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	f["size"], f["sha256"] = n, hex.EncodeToString(h.Sum(nil))
	if err != nil {
		f["complete"] = false
	}
}
