package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestServeTLSUsage: TLS settings that cannot work stop cage serve before
// it starts anything, with one line and exit 64, and write nothing into
// the data directory (no CA is made for a refused start).
func TestServeTLSUsage(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "key.pem")
	if err := os.WriteFile(key, []byte("not a key"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls-self-signed"}, "needs the sandbox domain"},
		{[]string{"--tls-self-signed", "--domain", "a b.example:3001"}, "not a DNS name"},
		{[]string{"--tls-cert", key}, "both the certificate and the key"},
		{[]string{"--tls-cert", key, "--tls-key", key}, "chmod 600"},
		{[]string{"--tls-cert", key, "--tls-key", key, "--tls-self-signed"}, "give one"},
	} {
		data := t.TempDir()
		var out, errOut bytes.Buffer
		args := append([]string{"serve", "--data", data, "--api", "127.0.0.1:0", "--proxy", "127.0.0.1:0"}, c.args...)
		code := Main(args, &out, &errOut)
		msg := strings.TrimSpace(errOut.String())
		if code != ExitUsage || !strings.Contains(msg, c.want) || strings.Count(msg, "\n") != 0 {
			t.Errorf("cage %v: exit %d, stderr %q; want exit %d and one line containing %q", args, code, msg, ExitUsage, c.want)
		}
		if entries, _ := os.ReadDir(data); len(entries) != 0 {
			t.Errorf("cage %v: the data directory holds %d entries; want none", args, len(entries))
		}
	}
}
