package agent

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCompressesOnlyLargeMessages: a client that accepts gzip gets a small
// answer uncompressed (gzip would cost the agent a compressor for a few
// bytes) and a large one compressed.
func TestCompressesOnlyLargeMessages(t *testing.T) {
	s, srv := newAuthServer(t, nil)
	big := filepath.Join(s.cfg.Root, "home/user/big")
	if err := os.MkdirAll(big, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range 200 {
		if err := os.WriteFile(filepath.Join(big, fmt.Sprintf("file-with-a-long-name-%04d", i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		proc, body, wantEncoding string
	}{
		{"Stat", `{"path":"/home/user"}`, ""},
		{"ListDir", `{"path":"/home/user/big"}`, "gzip"},
	} {
		req, _ := http.NewRequest("POST", srv.URL+"/filesystem.Filesystem/"+c.proc, strings.NewReader(c.body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept-Encoding", "gzip")
		req.Header.Set("X-Access-Token", fsTestToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", c.proc, resp.StatusCode, body)
		}
		if got := resp.Header.Get("Content-Encoding"); got != c.wantEncoding {
			t.Errorf("%s (%d bytes on the wire): Content-Encoding %q, want %q", c.proc, len(body), got, c.wantEncoding)
		}
	}
}
