package mcp

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
)

// The file tools go to the sandbox's agent (GET and POST /files, ListDir),
// which resolves every path inside the sandbox's root as the requesting
// user: a path with .. or a symlink to a host path reaches only what that
// user reaches inside. Nothing here opens a path on the host.

type readIn struct {
	SandboxID string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	Path      string `json:"path" jsonschema:"the file: absolute, or relative to the user's home"`
	Encoding  string `json:"encoding,omitempty" jsonschema:"auto (text if the file is UTF-8, image content for PNG, JPEG, GIF and WebP, else base64), utf8 or base64"`
	Offset    int64  `json:"offset,omitempty" jsonschema:"first byte to read"`
	MaxBytes  int64  `json:"max_bytes,omitempty" jsonschema:"most bytes to read; truncated says whether the file goes on"`
	User      string `json:"user,omitempty" jsonschema:"account to act as, e.g. root (default: the sandbox's default user)"`
}

var readSchema = lazySchema[readIn](func(p props) {
	p.sandboxID().minLen("path", 1).maxLen("path", maxPathLen).def("encoding", "auto").enum("encoding", "auto", "utf8", "base64").
		rng("offset", 0, 1<<62).def("max_bytes", defaultReadBytes).rng("max_bytes", 1, maxReadBytes).maxLen("user", 64)
})

type readOut struct {
	Path      string `json:"path"`
	Size      int64  `json:"size" jsonschema:"the file's size in bytes (-1: unknown, as for files under /proc)"`
	Offset    int64  `json:"offset"`
	Bytes     int    `json:"bytes" jsonschema:"bytes returned"`
	Encoding  string `json:"encoding" jsonschema:"utf8, base64, or image (returned as image content)"`
	MimeType  string `json:"mime_type,omitempty"`
	Content   string `json:"content,omitempty" jsonschema:"the bytes, as encoding says (absent for an image)"`
	Truncated bool   `json:"truncated" jsonschema:"the file goes on past what was returned: read on with offset"`
}

// imageTypes are the image types returned as image content.
var imageTypes = map[string]bool{"image/png": true, "image/jpeg": true, "image/gif": true, "image/webp": true}

func (t *tools) readFile(ctx context.Context, _ *sdk.CallToolRequest, in readIn) (*sdk.CallToolResult, readOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, readOut{}, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, readOut{}, err
	}
	max := in.MaxBytes
	if max == 0 {
		max = defaultReadBytes
	}
	if max < 1 || max > maxReadBytes || in.Offset < 0 {
		return nil, readOut{}, fmt.Errorf("max_bytes %d, offset %d: want max_bytes 1 to %d and offset 0 or more", max, in.Offset, maxReadBytes)
	}
	sb, err := t.reach(ctx, in.SandboxID)
	if err != nil {
		return nil, readOut{}, err
	}
	defer sb.release()
	data, size, err := t.download(ctx, sb.agent, in, max)
	if err != nil {
		return nil, readOut{}, err
	}
	out := readOut{Path: in.Path, Size: size, Offset: in.Offset, Bytes: len(data)}
	out.Truncated = size < 0 && int64(len(data)) == max || size > in.Offset+int64(len(data))
	return encodeRead(in.Encoding, data, out)
}

// download reads at most max bytes from offset; size is the file's (-1
// when the agent cannot tell).
func (t *tools) download(ctx context.Context, ac *agentclient.Client, in readIn, max int64) ([]byte, int64, error) {
	q := url.Values{"path": {in.Path}}
	if in.User != "" {
		q.Set("username", in.User)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, agentclient.BaseURL+"/files?"+q.Encode(), nil)
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", in.Offset, in.Offset+max-1))
	resp, err := ac.HTTP.Do(req)
	if err != nil {
		return nil, 0, t.failure(err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusPartialContent:
		data, err := io.ReadAll(io.LimitReader(resp.Body, max))
		return data, rangeTotal(resp.Header.Get("Content-Range")), err
	case http.StatusRequestedRangeNotSatisfiable: // offset at or past the end
		return []byte{}, rangeTotal(resp.Header.Get("Content-Range")), nil
	case http.StatusOK: // no sizes to serve ranges by (/proc): the whole stream
		if _, err := io.CopyN(io.Discard, resp.Body, in.Offset); err != nil {
			return []byte{}, -1, nil
		}
		data, err := io.ReadAll(io.LimitReader(resp.Body, max))
		if err != nil {
			return nil, 0, err
		}
		if n, _ := resp.Body.Read(make([]byte, 1)); n == 0 {
			return data, in.Offset + int64(len(data)), nil
		}
		return data, -1, nil
	}
	return nil, 0, agentHTTPError(resp)
}

// rangeTotal reads the size from "bytes a-b/size" or "bytes */size".
func rangeTotal(cr string) int64 {
	_, total, ok := strings.Cut(cr, "/")
	if n, err := strconv.ParseInt(total, 10, 64); ok && err == nil {
		return n
	}
	return -1
}

// agentHTTPError is the message of an agent's error answer.
func agentHTTPError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	var e struct {
		Message string `json:"message"`
	}
	msg := strings.TrimSpace(string(b))
	if json.Unmarshal(b, &e) == nil && e.Message != "" {
		msg = e.Message
	}
	if resp.StatusCode == http.StatusUnauthorized {
		return errors.New("the sandbox's agent refused the request (the sandbox may have ended)")
	}
	return fmt.Errorf("%s (HTTP %d)", clip(msg, 500), resp.StatusCode)
}

func encodeRead(enc string, data []byte, out readOut) (*sdk.CallToolResult, readOut, error) {
	mime := http.DetectContentType(data)
	if enc == "" || enc == "auto" {
		switch {
		case imageTypes[mime] && !out.Truncated && out.Offset == 0:
			out.Encoding, out.MimeType = "image", mime
			text := fmt.Sprintf("%s: %s image, %d bytes", out.Path, mime, len(data))
			return &sdk.CallToolResult{Content: []sdk.Content{&sdk.TextContent{Text: text},
				&sdk.ImageContent{Data: data, MIMEType: mime}}}, out, nil
		case imageTypes[mime]:
			return nil, readOut{}, fmt.Errorf("%s is a %s image of %d bytes, more than max_bytes: read it whole (max_bytes up to %d) to get it as an image, or with encoding base64",
				out.Path, mime, out.Size, maxReadBytes)
		case utf8.Valid(trimPartialRune(data, out.Truncated)):
			enc = "utf8"
		default:
			enc = "base64"
		}
	}
	switch enc {
	case "utf8":
		text := trimPartialRune(data, out.Truncated)
		if !utf8.Valid(text) {
			return nil, readOut{}, fmt.Errorf("%s is not UTF-8 text (%s): read it with encoding base64", out.Path, mime)
		}
		out.Bytes, out.Content = len(text), string(text)
	case "base64":
		out.Content = base64.StdEncoding.EncodeToString(data)
	default:
		return nil, readOut{}, fmt.Errorf("encoding %q: want auto, utf8 or base64", clip(enc, 40))
	}
	out.Encoding = enc
	content := []sdk.Content{&sdk.TextContent{Text: out.Content}}
	if out.Truncated {
		content = append(content, &sdk.TextContent{Text: fmt.Sprintf("[cage: %d bytes from offset %d of %s; the file goes on (size %d): read on with offset %d]",
			out.Bytes, out.Offset, out.Path, out.Size, out.Offset+int64(out.Bytes))})
	}
	return &sdk.CallToolResult{Content: content}, out, nil
}

// trimPartialRune drops a rune cut at the end of a truncated read.
func trimPartialRune(b []byte, truncated bool) []byte {
	if !truncated {
		return b
	}
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return b[:i]
			}
			break
		}
	}
	return b
}

type writeIn struct {
	SandboxID string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	Path      string `json:"path" jsonschema:"the file: absolute, or relative to the user's home; missing directories are made, an existing file is replaced"`
	Content   string `json:"content" jsonschema:"what the file holds, as encoding says"`
	Encoding  string `json:"encoding,omitempty" jsonschema:"utf8 (the text as it is) or base64 (binary data)"`
	Mode      string `json:"mode,omitempty" jsonschema:"permissions in octal, e.g. 0755 (default: 0644, or those of the file replaced)"`
	User      string `json:"user,omitempty" jsonschema:"account to act as, e.g. root (default: the sandbox's default user)"`
}

var writeSchema = lazySchema[writeIn](func(p props) {
	p.sandboxID().minLen("path", 1).maxLen("path", maxPathLen).maxLen("content", maxWriteBytes*4/3+4).
		def("encoding", "utf8").enum("encoding", "utf8", "base64").pattern("mode", modeRE().String()).maxLen("user", 64)
})

type writeOut struct {
	Path string `json:"path" jsonschema:"the absolute path written"`
	Size int    `json:"size" jsonschema:"bytes written"`
}

func (t *tools) writeFile(ctx context.Context, _ *sdk.CallToolRequest, in writeIn) (*sdk.CallToolResult, writeOut, error) {
	data, err := checkWrite(in)
	if err != nil {
		return nil, writeOut{}, err
	}
	sb, err := t.reach(ctx, in.SandboxID)
	if err != nil {
		return nil, writeOut{}, err
	}
	defer sb.release()
	q := url.Values{"path": {in.Path}}
	if in.User != "" {
		q.Set("username", in.User)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, agentclient.BaseURL+"/files?"+q.Encode(), bytes.NewReader(data))
	if err != nil {
		return nil, writeOut{}, err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := sb.agent.HTTP.Do(req)
	if err != nil {
		return nil, writeOut{}, t.failure(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, writeOut{}, agentHTTPError(resp)
	}
	var entries []struct {
		Path string `json:"path"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&entries); err != nil || len(entries) != 1 {
		return nil, writeOut{}, fmt.Errorf("the agent's answer to the upload is not one entry: %v", err)
	}
	out := writeOut{Path: entries[0].Path, Size: len(data)}
	if in.Mode != "" {
		if err := t.chmod(ctx, sb.agent, in.Mode, out.Path, in.User); err != nil {
			return nil, writeOut{}, fmt.Errorf("%s was written, but its mode was not set: %v", out.Path, err)
		}
	}
	return nil, out, nil
}

func checkWrite(in writeIn) ([]byte, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, err
	}
	if in.Mode != "" && !modeRE().MatchString(in.Mode) {
		return nil, fmt.Errorf("mode %q: want octal permissions such as 0644 or 755", clip(in.Mode, 20))
	}
	var data []byte
	switch in.Encoding {
	case "", "utf8":
		data = []byte(in.Content)
	case "base64":
		var err error
		if data, err = base64.StdEncoding.DecodeString(strings.TrimSpace(in.Content)); err != nil {
			return nil, fmt.Errorf("content is not base64: %v", err)
		}
	default:
		return nil, fmt.Errorf("encoding %q: want utf8 or base64", clip(in.Encoding, 40))
	}
	if len(data) > maxWriteBytes {
		return nil, fmt.Errorf("content is %d bytes, over %d: split it, or fetch it from inside the sandbox with exec", len(data), maxWriteBytes)
	}
	return data, nil
}

// chmod sets a file's permissions with the template's chmod, as the user.
// What it says on stderr comes through the agent, which is inside the
// wall: only its head is kept, for the error (all of it was, as fast as
// the agent sent it, for up to the 30 s: found by review, 2026-12-05).
func (t *tools) chmod(ctx context.Context, ac *agentclient.Client, mode, path, user string) error {
	stderr := newCapture(maxChmodStderr)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "chmod", Args: []string{mode, "--", path}, User: user,
		Stdout: io.Discard, Stderr: stderr, TimeoutMs: 30000, MaxOutput: maxChmodStderr})
	if err != nil {
		return t.failure(err)
	}
	if end.GetExitCode() != 0 || !end.GetExited() {
		text, _ := stderr.text("stderr")
		return fmt.Errorf("chmod: %s", clip(strings.TrimSpace(text), 300))
	}
	return nil
}

// maxChmodStderr bounds what chmod's stderr is kept of (the error shows
// 300 bytes of it).
const maxChmodStderr = 4 << 10

type listFilesIn struct {
	SandboxID  string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	Path       string `json:"path,omitempty" jsonschema:"the directory: absolute, or relative to the user's home"`
	Depth      int    `json:"depth,omitempty" jsonschema:"levels to descend: 1 lists the directory itself"`
	MaxEntries int    `json:"max_entries,omitempty" jsonschema:"most entries to return; truncated says whether there were more"`
	User       string `json:"user,omitempty" jsonschema:"account to act as, e.g. root (default: the sandbox's default user)"`
}

var listFilesSchema = lazySchema[listFilesIn](func(p props) {
	p.sandboxID().def("path", "~").maxLen("path", maxPathLen).def("depth", 1).rng("depth", 1, maxListDepth).
		def("max_entries", defaultListEntries).rng("max_entries", 1, maxListEntries).maxLen("user", 64)
})

type entryOut struct {
	Name          string    `json:"name"`
	Path          string    `json:"path"`
	Type          string    `json:"type" jsonschema:"file, dir or symlink"`
	Size          int64     `json:"size"`
	Mode          string    `json:"mode" jsonschema:"permissions in octal"`
	Owner         string    `json:"owner,omitempty"`
	Modified      time.Time `json:"modified"`
	SymlinkTarget string    `json:"symlink_target,omitempty"`
}

type listFilesOut struct {
	Path      string     `json:"path"`
	Entries   []entryOut `json:"entries"`
	Total     int        `json:"total" jsonschema:"entries found"`
	Truncated bool       `json:"truncated" jsonschema:"more entries than max_entries were found"`
}

func (t *tools) listFiles(ctx context.Context, _ *sdk.CallToolRequest, in listFilesIn) (*sdk.CallToolResult, listFilesOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, listFilesOut{}, err
	}
	if in.Path == "" {
		in.Path = "~"
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, listFilesOut{}, err
	}
	depth, limit := max(in.Depth, 1), in.MaxEntries
	if limit == 0 {
		limit = defaultListEntries
	}
	if depth > maxListDepth || limit < 1 || limit > maxListEntries {
		return nil, listFilesOut{}, fmt.Errorf("depth %d, max_entries %d: want depth 1 to %d and max_entries 1 to %d", depth, limit, maxListDepth, maxListEntries)
	}
	sb, err := t.reach(ctx, in.SandboxID)
	if err != nil {
		return nil, listFilesOut{}, err
	}
	defer sb.release()
	req := connect.NewRequest(&fspb.ListDirRequest{Path: in.Path, Depth: uint32(depth)})
	if in.User != "" {
		req.Header().Set("Authorization", agentclient.UserHeader(in.User))
	}
	l, err := sb.agent.ListDir(ctx, req, limit)
	if err != nil {
		return nil, listFilesOut{}, t.failure(err)
	}
	out := listFilesOut{Path: in.Path, Entries: []entryOut{}, Total: l.Total, Truncated: l.Truncated}
	for _, e := range l.Entries {
		out.Entries = append(out.Entries, entryOut{Name: e.GetName(), Path: e.GetPath(), Type: fileType(e.GetType()),
			Size: e.GetSize(), Mode: fmt.Sprintf("%04o", e.GetMode()&0o7777), Owner: e.GetOwner(),
			Modified: e.GetModifiedTime().AsTime().UTC(), SymlinkTarget: e.GetSymlinkTarget()})
	}
	return nil, out, nil
}

func fileType(t fspb.FileType) string {
	switch t {
	case fspb.FileType_FILE_TYPE_DIRECTORY:
		return "dir"
	case fspb.FileType_FILE_TYPE_SYMLINK:
		return "symlink"
	case fspb.FileType_FILE_TYPE_FILE:
		return "file"
	}
	return "other"
}

// fileWithin bounds a file tool's call (file_read, file_write,
// file_list): the agent answers these at once, and moves at most a few
// MiB for them. It is inside the wall: one that never answered held the
// call, a daemon goroutine and one of the key's 16 /mcp requests for as
// long as the MCP client waited (found by review, 2026-12-05). A
// variable for the tests.
var fileWithin = 2 * time.Minute

// agentBound is a tool f whose call ends after *within, with an error
// that says the agent did not answer when that is why it failed.
func agentBound[In, Out any](within *time.Duration, f func(context.Context, *sdk.CallToolRequest, In) (*sdk.CallToolResult, Out, error)) func(context.Context, *sdk.CallToolRequest, In) (*sdk.CallToolResult, Out, error) {
	return func(ctx context.Context, req *sdk.CallToolRequest, in In) (*sdk.CallToolResult, Out, error) {
		d := *within
		bctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		r, out, err := f(bctx, req, in)
		if err != nil && bctx.Err() != nil && ctx.Err() == nil {
			var zero Out
			return nil, zero, fmt.Errorf("the sandbox's agent did not answer within %v", d)
		}
		return r, out, err
	}
}
