package inside

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Attack: an image (a template anyone may create sandboxes from) carries
// a sparse /etc/passwd of 256 MiB, which costs it nothing to ship or
// store; the OCI walls prepare the root in the daemon, which read the file
// whole and made strings of it (some 4 GiB of daemon memory for each
// create of a 1 GiB one). Expected: the create is refused with a
// one-line reason, having read at most the limit; a plain passwd gets the
// sandbox's accounts appended and keeps its own lines.
func TestImageAccountsFilesBounded(t *testing.T) {
	id := func(n int) int { return os.Getuid() }
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	passwd := filepath.Join(root, "etc", "passwd")
	f, err := os.Create(passwd)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(256 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	err = PrepareImageRoot(root, "h", id, false)
	if err == nil || !strings.Contains(err.Error(), "/etc/passwd is larger than 1024 KiB") || strings.Contains(err.Error(), "\n") {
		t.Errorf("a 256 MiB passwd: %v; want a one-line refusal", err)
	}
	if err := os.WriteFile(passwd, []byte("root:x:0:0:root:/root:/bin/sh\ndaemon:x:1:1::/:/bin/false\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := PrepareImageRoot(root, "h", id, false); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(passwd)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(b); !strings.HasPrefix(got, "root:x:0:0:root:/root:/bin/sh\ndaemon:x:1:1::/:/bin/false\n") || !strings.Contains(got, "\n"+UserName+":x:") {
		t.Errorf("passwd after: %q; want the image's lines and the sandbox's user", got)
	}
}
