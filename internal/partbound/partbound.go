// Package partbound reads a multipart body with each part's boundary and
// header bounded: the agent's uploads (/files) and the audit trail's
// parser of them, which reads an upload as the agent does, share it. A
// leaf of the standard library only: the agent links it.
package partbound

import (
	"fmt"
	"io"
	"mime/multipart"
)

// MaxHeader bounds what one part's boundary and header may take (an
// SDK's is some 200 bytes: a path of at most 4 KiB, a type). Go's
// multipart reader keeps up to 10 MiB of a header while it reads it:
// found by review, 2026-12-04, an upload that sent 8 MiB of one and held
// the rest back held 8 MiB of its reader (the agent: the sandbox's
// memory; the trail: the daemon's) for as long as its client liked.
const MaxHeader = 64 << 10

// ErrHeader is what NextPart's error wraps for a part whose boundary and
// header are longer than MaxHeader.
var ErrHeader = fmt.Errorf("a multipart part's boundary and header are longer than %d bytes", MaxHeader)

// Reader is a multipart.Reader whose NextPart reads at most MaxHeader
// bytes; a part's body is read unbounded (its reader bounds what it
// keeps).
type Reader struct {
	mr *multipart.Reader
	b  *bound
}

// NewReader reads the multipart body r, parts separated by boundary.
func NewReader(r io.Reader, boundary string) *Reader {
	b := &bound{r: r, left: -1}
	return &Reader{mr: multipart.NewReader(b, boundary), b: b}
}

// NextPart is multipart.Reader's, with an error that wraps ErrHeader for
// a part whose boundary and header run past MaxHeader.
func (r *Reader) NextPart() (*multipart.Part, error) {
	r.b.left = MaxHeader
	p, err := r.mr.NextPart()
	r.b.left = -1
	return p, err
}

// bound fails a read once left bytes are read, while left >= 0 (-1: no
// bound).
type bound struct {
	r    io.Reader
	left int64
}

func (b *bound) Read(p []byte) (int, error) {
	if b.left < 0 {
		return b.r.Read(p)
	}
	if b.left == 0 {
		return 0, ErrHeader
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}
