package agent

import (
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/cagehq/cage/internal/filesig"
	"github.com/cagehq/cage/internal/partbound"
	"golang.org/x/sys/unix"
)

// GET and POST /files: streamed download and upload, E2B envd compatible.
// Uploads go to a temporary file beside the destination and are renamed into
// place, so a failed upload leaves nothing half-written. Both run as the
// requesting user (see asUser), never as the agent.

// uploadTempPrefix names the temporary files uploads write; watches hide them.
const uploadTempPrefix = ".cage-upload-"

// uploadedEntry is one element of the upload reply.
type uploadedEntry struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// httpError is an error with the HTTP status it answers with.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func httpErr(status int, format string, args ...any) *httpError {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

// writeHTTPError replies with E2B's error shape: {"code": 404, "message": "..."}.
func writeHTTPError(w http.ResponseWriter, err *httpError) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Encoding")
	w.Header().Del("Content-Disposition")
	w.WriteHeader(err.status)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": err.status, "message": err.msg})
}

// fileHTTPError maps an error from operation op on sandbox path p.
func fileHTTPError(op, p string, err error) *httpError {
	var he *httpError
	if errors.As(err, &he) {
		return he
	}
	msg := err.Error()
	var errno unix.Errno
	if errors.As(err, &errno) {
		msg = errno.Error()
	}
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		status = http.StatusInsufficientStorage
		msg = "not enough disk space: " + msg
	case errors.Is(err, unix.ENOENT):
		status = http.StatusNotFound
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM), errors.Is(err, unix.EROFS):
		status = http.StatusForbidden
	case errnoCode(err) == connect.CodeInvalidArgument, errors.Is(err, unix.EEXIST), errors.Is(err, unix.ENOTEMPTY):
		status = http.StatusBadRequest
	}
	return httpErr(status, "%s %q: %s", op, p, msg)
}

// authorizeFiles checks a /files request: the access token header, or a
// signature over path, operation, username (and expiration) made with it.
func (f *filesystemService) authorizeFiles(r *http.Request, op string) *httpError {
	token := f.s.cfg.Token
	if token == "" {
		return nil
	}
	if r.Header.Get("X-Access-Token") != "" {
		if f.s.tokenOK(r.Header) {
			return nil
		}
		return httpErr(http.StatusUnauthorized, "invalid access token")
	}
	if err := filesig.Check(r.URL.Query(), op, token, time.Now()); err != nil {
		return httpErr(http.StatusUnauthorized, "%v", err)
	}
	return nil
}

// filesUser is the user a /files request acts as: like any request's, never
// the agent's own uid.
func (f *filesystemService) filesUser(q url.Values) (User, *httpError) {
	name := q.Get("username")
	if name == "" {
		name = f.s.cfg.DefaultUser
	}
	u, err := f.s.lookupUser(name)
	if err != nil {
		var ce *connect.Error
		if errors.As(err, &ce) {
			return User{}, httpErr(http.StatusBadRequest, "%s", ce.Message())
		}
		return User{}, httpErr(http.StatusBadRequest, "%v", err)
	}
	return u, nil
}

// serveFiles serves GET and POST /files. The token or signature is checked
// before anything else, the body is read (if at all) only after that.
func (f *filesystemService) serveFiles(w http.ResponseWriter, r *http.Request) {
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	if herr := f.authorizeFiles(r, op); herr != nil {
		writeHTTPError(w, herr)
		return
	}
	u, herr := f.filesUser(r.URL.Query())
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	root, err := openFSRoot(f.s.cfg.Root)
	if err != nil {
		writeHTTPError(w, httpErr(http.StatusInternalServerError, "sandbox root is not available"))
		return
	}
	defer root.Close()
	if op == "write" {
		f.serveUpload(w, r, u, root)
		return
	}
	f.serveDownload(w, r, u, root)
}

// The file work of a transfer (resolving, opening, renaming) runs as the
// user on one of the agent's few file workers (asUser); the bytes move
// between the network and a descriptor the user opened outside it, at
// whatever pace the client keeps. Holding a worker while they moved, four
// stalled transfers (anyone's with a signed URL) held every file operation
// of the sandbox for as long as their clients liked (found by review,
// 2026-12-04).

// asUserErr answers a failure to act as the user (nothing when the
// client has gone).
func asUserErr(w http.ResponseWriter, u User, err error) {
	if !errors.Is(err, context.Canceled) {
		writeHTTPError(w, fileHTTPError("act as user", u.Name, err))
	}
}

// serveDownload opens the file as the request's user, then sends it.
func (f *filesystemService) serveDownload(w http.ResponseWriter, r *http.Request, u User, root *fsRoot) {
	raw := r.URL.Query().Get("path")
	p, err := sandboxPath(raw, u)
	if err != nil {
		writeHTTPError(w, httpErr(http.StatusBadRequest, "invalid path %q: %v", raw, err))
		return
	}
	var file *os.File
	var st *unix.Stat_t
	var herr *httpError
	if err := f.s.asUser(r.Context(), u, func() error {
		file, st, herr = openDownload(root, p)
		return nil
	}); err != nil {
		asUserErr(w, u, err)
		return
	}
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	defer file.Close()
	name := path.Base(p)
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": name}))
	h.Set("Vary", "Accept-Encoding")
	ranged := r.Header.Get("Range") != "" || r.Header.Get("If-Range") != ""
	switch {
	case !ranged && acceptsGzip(r.Header.Get("Accept-Encoding")):
		h.Set("Content-Encoding", "gzip")
		gz := gzip.NewWriter(w)
		if _, err := io.Copy(gz, file); err != nil {
			f.s.log.Warn("gzip download cut short", "path", p, "err", err)
		}
		_ = gz.Close()
	case st.Size == 0:
		// Empty, or generated on read like /proc files: no size to serve by.
		if _, err := io.Copy(w, file); err != nil {
			f.s.log.Warn("download cut short", "path", p, "err", err)
		}
	default:
		http.ServeContent(w, r, name, time.Unix(st.Mtim.Sec, st.Mtim.Nsec), file)
	}
}

// openDownload opens regular file p for reading.
func openDownload(root *fsRoot, p string) (*os.File, *unix.Stat_t, *httpError) {
	// O_NONBLOCK: a FIFO planted at p must not hang the request.
	fd, err := root.open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fileHTTPError("read", p, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, nil, fileHTTPError("read", p, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		unix.Close(fd)
		return nil, nil, httpErr(http.StatusBadRequest, "path %q is a directory", p)
	default:
		unix.Close(fd)
		return nil, nil, httpErr(http.StatusBadRequest, "path %q is not a regular file", p)
	}
	_ = unix.SetNonblock(fd, false)
	return os.NewFile(uintptr(fd), path.Base(p)), &st, nil
}

// acceptsGzip reports whether an Accept-Encoding header allows gzip.
func acceptsGzip(header string) bool {
	for _, part := range strings.Split(header, ",") {
		enc, params, _ := strings.Cut(part, ";")
		enc = strings.ToLower(strings.TrimSpace(enc))
		if enc != "gzip" && enc != "x-gzip" {
			continue
		}
		k, v, ok := strings.Cut(strings.TrimSpace(params), "=")
		if ok && strings.TrimSpace(k) == "q" {
			q, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return err == nil && q > 0
		}
		return true
	}
	return false
}

// serveUpload writes the body's files as the request's user (see
// uploader.write). The body is streamed to disk (a full disk is 507); a
// gzip-encoded one may inflate to at most Config.MaxInflatedUpload bytes
// (413 beyond).
func (f *filesystemService) serveUpload(w http.ResponseWriter, r *http.Request, u User, root *fsRoot) {
	defer r.Body.Close()
	body := io.Reader(r.Body)
	if enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc == "gzip" || enc == "x-gzip" {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			writeHTTPError(w, httpErr(http.StatusBadRequest, "invalid gzip body: %v", err))
			return
		}
		defer gz.Close()
		body = &inflateLimit{r: gz, left: f.s.cfg.MaxInflatedUpload}
	} else if enc != "" && enc != "identity" {
		writeHTTPError(w, httpErr(http.StatusBadRequest, "unsupported content encoding %q", enc))
		return
	}
	md, herr := metadataFromHeaders(r.Header)
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	ctx := r.Context()
	up := uploader{root: root, u: u, q: r.URL.Query(), md: md,
		asUser: func(keep bool, fn func() error) error {
			c := ctx
			if keep {
				c = context.WithoutCancel(ctx) // finishing or cleaning up what was begun
			}
			return f.s.asUser(c, u, fn)
		}}
	var entries []uploadedEntry
	media, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch {
	case media == "application/octet-stream":
		entries, herr = up.raw(body)
	case strings.HasPrefix(media, "multipart/") && params["boundary"] != "":
		entries, herr = up.multipart(partbound.NewReader(body, params["boundary"]))
	default:
		herr = httpErr(http.StatusBadRequest, "unsupported content type %q: expected multipart/form-data or application/octet-stream", media)
	}
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	writeEntries(w, entries)
}

// writeEntries answers an upload with its list of files, one entry
// encoded at a time: the answer (JSON's escapes may make it six times
// what maxUploadListed counts) is never whole in memory.
func writeEntries(w http.ResponseWriter, entries []uploadedEntry) {
	w.Header().Set("Content-Type", "application/json")
	sep := "["
	for _, e := range entries {
		b, err := json.Marshal(e)
		if err != nil {
			return
		}
		if _, err := io.WriteString(w, sep); err != nil {
			return
		}
		if _, err := w.Write(b); err != nil {
			return
		}
		sep = ","
	}
	if sep == "[" {
		_, _ = io.WriteString(w, "[")
	}
	_, _ = io.WriteString(w, "]\n")
}

// inflateLimit ends a decompressed body that grows past its limit.
type inflateLimit struct {
	r    io.Reader
	left int64
}

func (l *inflateLimit) Read(p []byte) (int, error) {
	if l.left <= 0 {
		// One byte more would tell a body of exactly the limit from a
		// larger one; a bomb is all this has to stop.
		var one [1]byte
		if n, _ := io.ReadFull(l.r, one[:]); n == 0 {
			return 0, io.EOF
		}
		return 0, errInflateLimit
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	return n, err
}

var errInflateLimit = errors.New("the decompressed upload is larger than the agent accepts")

const (
	// maxUploadFiles bounds the files of one multipart upload.
	maxUploadFiles = 10000
	// maxUploadListed bounds an upload's answer, the list of its files
	// (paths, names, the metadata each repeats, listedEntryCost each),
	// which the agent holds until the upload ends. Found by review,
	// 2026-12-05: 10,000 files of 4 KB paths held some 80 MiB of the
	// agent (the sandbox's memory) and made an answer of 38 MB, built
	// whole before a byte went out; now some 5 MiB. E2B's SDK sends one part per file
	// (files.write of several): 1,000 files of 200-byte paths and 1 KiB
	// of metadata list some 1.3 MiB; 10,000 files, paths of 300 bytes.
	maxUploadListed = 4 << 20
	listedEntryCost = 64
)

// uploader writes the files of one upload request.
type uploader struct {
	root *fsRoot
	u    User
	q    url.Values
	md   map[string]string // metadata every file of the upload gets
	// asUser runs fn as the user on a file worker; keep runs it even
	// once the request is cancelled.
	asUser func(keep bool, fn func() error) error
}

func (up *uploader) resolve(raw string) (string, *httpError) {
	p, err := sandboxPath(raw, up.u)
	if err != nil {
		return "", httpErr(http.StatusBadRequest, "invalid path %q: %v", raw, err)
	}
	return p, nil
}

func (up *uploader) raw(body io.Reader) ([]uploadedEntry, *httpError) {
	if !up.q.Has("path") {
		return nil, httpErr(http.StatusBadRequest, "the path query parameter is required for an octet-stream upload")
	}
	p, herr := up.resolve(up.q.Get("path"))
	if herr != nil {
		return nil, herr
	}
	if err := up.write(p, body); err != nil {
		return nil, fileHTTPError("write", p, err)
	}
	return []uploadedEntry{{Path: p, Name: path.Base(p), Type: "file", Metadata: up.md}}, nil
}

func (up *uploader) multipart(mr *partbound.Reader) ([]uploadedEntry, *httpError) {
	entries := []uploadedEntry{}
	seen := map[string]bool{}
	listed, mdSize := 0, 0 // bytes the answer lists, about; of one file's metadata
	for k, v := range up.md {
		mdSize += len(k) + len(v)
	}
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			return entries, nil
		}
		if errors.Is(err, partbound.ErrHeader) {
			return nil, httpErr(http.StatusBadRequest, "%v", err)
		}
		if err != nil {
			return nil, httpErr(http.StatusBadRequest, "reading multipart body: %v", err)
		}
		if part.FormName() != "file" {
			// Read past here, not under the next header's bound.
			if _, err := io.Copy(io.Discard, part); err != nil {
				return nil, httpErr(http.StatusBadRequest, "reading multipart body: %v", err)
			}
			continue
		}
		raw := up.q.Get("path")
		if !up.q.Has("path") {
			raw = partFileName(part)
		}
		p, herr := up.resolve(raw)
		if herr != nil {
			return nil, herr
		}
		if seen[p] {
			return nil, httpErr(http.StatusBadRequest, "path %q appears more than once in one upload", p)
		}
		if len(seen) >= maxUploadFiles {
			return nil, httpErr(http.StatusRequestEntityTooLarge, "more than %d files in one upload", maxUploadFiles)
		}
		listed += len(p) + len(path.Base(p)) + mdSize + listedEntryCost
		if listed > maxUploadListed {
			return nil, httpErr(http.StatusRequestEntityTooLarge,
				"the upload's list of files (paths, names and metadata) would pass %d bytes at %.64q: the %d files before it were written, it and the rest were not; send them in several uploads",
				maxUploadListed, p, len(entries))
		}
		seen[p] = true
		if err := up.write(p, part); err != nil {
			return nil, fileHTTPError("write", p, err)
		}
		entries = append(entries, uploadedEntry{Path: p, Name: path.Base(p), Type: "file", Metadata: up.md})
	}
}

// partFileName is a part's filename as sent: the full path, which
// multipart.Part.FileName would cut down to its last element.
func partFileName(part *multipart.Part) string {
	_, params, err := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
	if err != nil {
		return ""
	}
	return params["filename"]
}

// readTracker remembers a read error, to tell it from a write error.
type readTracker struct {
	r   io.Reader
	err error
}

func (t *readTracker) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if err != nil && err != io.EOF {
		t.err = err
	}
	return n, err
}

// write streams src into the file at sandbox path p, as the user: the
// file is made and renamed into place as the user (on a file worker), the
// bytes are copied into it outside. A symlink at p that resolves to a file
// inside the root is written through (its target is replaced, where the
// user may replace it).
func (up *uploader) write(p string, src io.Reader) error {
	if p == "/" {
		return httpErr(http.StatusBadRequest, "path %q is a directory", p)
	}
	var t *tempFile
	if err := up.asUser(false, func() error {
		var err error
		t, err = up.begin(p)
		return err
	}); err != nil {
		return err
	}
	defer unix.Close(t.dfd)
	err := t.fill(src)
	if err == nil {
		err = up.asUser(true, func() error { return t.finish(up.md) })
	}
	if err != nil {
		_ = up.asUser(true, func() error { t.abandon(); return nil })
	}
	return err
}

// tempFile is an upload's new file, beside the name it will take.
type tempFile struct {
	dfd       int // O_PATH descriptor of the directory
	name, tmp string
	file      *os.File
	done      bool // renamed into place
}

// begin makes the temporary file that will take p's place, as the user.
func (up *uploader) begin(p string) (*tempFile, error) {
	target := p
	if st, err := up.root.lstat(p); err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
		if fd, err := up.root.open(p, unix.O_PATH, 0); err == nil {
			if real, ok := up.root.pathOf(fd); ok && real != "/" {
				target = real
			}
			unix.Close(fd)
		}
	}
	dfd, _, err := up.root.mkdirAll(path.Dir(target))
	if err != nil {
		return nil, err
	}
	t := &tempFile{dfd: dfd, name: path.Base(target)}
	ok := false
	defer func() {
		if !ok {
			t.abandon()
			unix.Close(dfd)
		}
	}()
	mode := uint32(0o644)
	var old unix.Stat_t
	if unix.Fstatat(dfd, t.name, &old, unix.AT_SYMLINK_NOFOLLOW) == nil {
		switch old.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			return nil, httpErr(http.StatusBadRequest, "path %q is a directory", p)
		case unix.S_IFREG:
			mode = old.Mode & 0o777
		}
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := uploadTempPrefix + hex.EncodeToString(rnd[:])
	how := unix.OpenHow{Flags: unix.O_WRONLY | unix.O_CREAT | unix.O_EXCL | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Mode: 0o600, Resolve: beneathNoLinks}
	fd, err := openat2(dfd, tmp, &how)
	if err != nil {
		return nil, err
	}
	t.tmp, t.file = tmp, os.NewFile(uintptr(fd), tmp)
	// The file is the user's: the thread acts as the user (see asUser).
	if err := unix.Fchmod(fd, mode); err != nil {
		return nil, err
	}
	ok = true
	return t, nil
}

// fill copies src into the file: no file worker is held, the descriptor
// was opened as the user.
func (t *tempFile) fill(src io.Reader) error {
	rt := &readTracker{r: src}
	if _, err := io.Copy(t.file, rt); err != nil {
		switch {
		case errors.Is(rt.err, errInflateLimit):
			return httpErr(http.StatusRequestEntityTooLarge, "%v", errInflateLimit)
		case rt.err != nil:
			return httpErr(http.StatusBadRequest, "reading upload body: %v", rt.err)
		}
		return err
	}
	return nil
}

// finish gives the file its metadata and renames it into place, as the
// user.
func (t *tempFile) finish(md map[string]string) error {
	if err := writeMetadata(int(t.file.Fd()), md); err != nil {
		if errors.Is(err, errNoXattrs) {
			return httpErr(http.StatusNotImplemented, "%v; the file was not written", err)
		}
		return err
	}
	if err := t.file.Close(); err != nil {
		return err
	}
	if err := unix.Renameat(t.dfd, t.tmp, t.dfd, t.name); err != nil {
		return err
	}
	t.done = true
	return nil
}

// abandon removes the temporary file of an upload that did not finish,
// as the user.
func (t *tempFile) abandon() {
	if t.done || t.file == nil {
		return
	}
	_ = t.file.Close()
	_ = unix.Unlinkat(t.dfd, t.tmp, 0)
}
