package agentclient

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/api/gen/filesystem/filesystemconnect"
)

// A directory's listing is the one message of the agent's that an honest
// agent makes large (a directory may hold millions of names), and the
// host wants only its first entries. ListDir reads it as it arrives and
// keeps at most what it was asked for; the rest is counted and dropped.
const (
	// maxListBytes bounds what is read of a listing (counted, not kept):
	// some 300,000 entries.
	maxListBytes = 64 << 20
	// maxKeptBytes bounds the entries kept, on the wire.
	maxKeptBytes = 4 << 20
	// maxEntryBytes bounds one entry (an honest one: a path and a link's
	// target of at most 4 KiB each, 4 KiB of metadata).
	maxEntryBytes = 64 << 10
)

// Listing is what ListDir kept of a directory's listing.
type Listing struct {
	Entries []*fspb.EntryInfo // the first entries, in the agent's order
	// Total is the number of entries listed: those read, when the
	// listing was longer than maxListBytes.
	Total int
	// Truncated: Entries holds fewer than Total, or the listing was
	// longer than maxListBytes.
	Truncated bool
}

// ListDir lists a directory (the agent's ListDir, req's headers sent
// with it), keeping at most keep entries. Its errors are Connect errors,
// as the generated client's.
func (c *Client) ListDir(ctx context.Context, req *connect.Request[fspb.ListDirRequest], keep int) (*Listing, error) {
	body, err := proto.Marshal(req.Msg)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL+filesystemconnect.FilesystemListDirProcedure, bytes.NewReader(body))
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	for k, v := range req.Header() {
		hr.Header[k] = v
	}
	hr.Header.Set("Content-Type", "application/proto")
	hr.Header.Set("Connect-Protocol-Version", "1")
	// Asked explicitly: nothing is inflated on the host's side.
	hr.Header.Set("Accept-Encoding", "identity")
	if dl, ok := ctx.Deadline(); ok {
		hr.Header.Set("Connect-Timeout-Ms", strconv.FormatInt(max(time.Until(dl).Milliseconds(), 1), 10))
	}
	resp, err := c.HTTP.Do(hr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, connect.NewError(connect.CodeOf(ctx.Err()), err)
		}
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, unaryError(resp)
	}
	if ce := resp.Header.Get("Content-Encoding"); ce != "" && ce != "identity" {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("the agent's listing is encoded %q, which was not asked for", ce))
	}
	l, err := readListing(resp.Body, keep)
	if err != nil {
		if ctx.Err() != nil {
			return nil, connect.NewError(connect.CodeOf(ctx.Err()), err)
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return l, nil
}

// readListing reads a ListDirResponse from r, keeping at most keep
// entries (and maxKeptBytes of them), at most maxListBytes read.
func readListing(r io.Reader, keep int) (*Listing, error) {
	cr := &countingReader{r: io.LimitReader(r, maxListBytes)}
	br := bufio.NewReader(cr)
	l := &Listing{Entries: []*fspb.EntryInfo{}}
	budget, kept := maxItems, 0
	var buf []byte
	entryType := (&fspb.EntryInfo{}).ProtoReflect().Descriptor()
	for {
		tag, err := binary.ReadUvarint(br)
		if err == io.EOF {
			if cr.n >= maxListBytes {
				l.Truncated = true
			}
			return l, nil
		}
		if err != nil {
			return cut(l, cr, err)
		}
		num, typ := protowire.DecodeTag(tag)
		var n uint64
		switch typ {
		case protowire.VarintType:
			_, err = binary.ReadUvarint(br)
		case protowire.Fixed32Type:
			_, err = br.Discard(4)
		case protowire.Fixed64Type:
			_, err = br.Discard(8)
		case protowire.BytesType:
			n, err = binary.ReadUvarint(br)
		default:
			return nil, fmt.Errorf("the agent's listing has a field of wire type %d", typ)
		}
		if err != nil {
			return cut(l, cr, err)
		}
		if typ != protowire.BytesType {
			continue
		}
		if n > maxEntryBytes {
			return nil, fmt.Errorf("the agent's listing has a field of %d bytes, more than %d", n, maxEntryBytes)
		}
		if num != 1 { // not an entry
			if _, err := br.Discard(int(n)); err != nil {
				return cut(l, cr, err)
			}
			continue
		}
		if len(l.Entries) >= keep || kept+int(n) > maxKeptBytes || budget == 0 {
			if _, err := br.Discard(int(n)); err != nil {
				return cut(l, cr, err)
			}
			l.Total, l.Truncated = l.Total+1, true
			continue
		}
		if cap(buf) < int(n) {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := io.ReadFull(br, buf); err != nil {
			return cut(l, cr, err)
		}
		l.Total++
		left := budget - 1
		if err := countItems(buf, entryType, &left, 0); errors.Is(err, errTooManyItems) {
			budget, l.Truncated = 0, true // kept no more
			continue
		} else if err != nil {
			return nil, fmt.Errorf("the agent's listing: %w", err)
		}
		e := &fspb.EntryInfo{}
		if err := proto.Unmarshal(buf, e); err != nil {
			return nil, fmt.Errorf("the agent's listing: %w", err)
		}
		budget, kept = left, kept+int(n)
		l.Entries = append(l.Entries, e)
	}
}

// cut ends a listing that stopped mid-field: past maxListBytes, what was
// read is the listing, truncated; before, the agent's answer was broken.
func cut(l *Listing, cr *countingReader, err error) (*Listing, error) {
	if cr.n >= maxListBytes && (err == io.EOF || err == io.ErrUnexpectedEOF) {
		l.Truncated = true
		return l, nil
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return nil, fmt.Errorf("reading the agent's listing: %w", err)
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// unaryError is the Connect error of an answer other than 200: the
// Connect protocol's JSON, else one named by the HTTP status as Connect
// names it.
func unaryError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	var e struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	var code connect.Code
	if json.Unmarshal(b, &e) == nil && e.Code != "" && code.UnmarshalText([]byte(e.Code)) == nil {
		return connect.NewError(code, errors.New(e.Message))
	}
	switch resp.StatusCode {
	case http.StatusBadRequest:
		code = connect.CodeInternal
	case http.StatusUnauthorized:
		code = connect.CodeUnauthenticated
	case http.StatusForbidden:
		code = connect.CodePermissionDenied
	case http.StatusNotFound:
		code = connect.CodeUnimplemented
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		code = connect.CodeUnavailable
	default:
		code = connect.CodeUnknown
	}
	return connect.NewError(code, fmt.Errorf("HTTP %s", resp.Status))
}
