package partbound

import (
	"bytes"
	"errors"
	"io"
	"mime/multipart"
	"net/textproto"
	"strings"
	"testing"
)

// TestHeaderBounded: a part whose header is 1 MiB fails NextPart with an
// error that wraps ErrHeader; a part before it whose body is 1 MiB is
// read whole (the bound is the header's, set again for each part), and
// a header just under the bound is read.
func TestHeaderBounded(t *testing.T) {
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", "/big-body")
	fw.Write(bytes.Repeat([]byte("b"), 1<<20))
	h := make(textproto.MIMEHeader)
	h.Set("Content-Disposition", `form-data; name="file"; filename="/near"`)
	h.Set("X-Pad", strings.Repeat("a", MaxHeader-200))
	fw, _ = mw.CreatePart(h)
	fw.Write([]byte("near"))
	h.Set("X-Pad", strings.Repeat("a", 1<<20))
	fw, _ = mw.CreatePart(h)
	fw.Write([]byte("padded"))
	mw.Close()

	r := NewReader(&body, mw.Boundary())
	for _, want := range []int{1 << 20, 4} {
		p, err := r.NextPart()
		if err != nil {
			t.Fatalf("part of %d bytes: %v", want, err)
		}
		n, err := io.Copy(io.Discard, p)
		if err != nil || n != int64(want) {
			t.Fatalf("part read %d bytes, %v; want %d", n, err, want)
		}
	}
	_, err := r.NextPart()
	if !errors.Is(err, ErrHeader) || !strings.Contains(err.Error(), "65536") {
		t.Errorf("a part with a header of 1 MiB: %v, want ErrHeader naming the bound", err)
	}
}
