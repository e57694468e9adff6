package process

import (
	"os"
	"path/filepath"
	"strings"
)

// Child side: the files that name this sandbox. The template's /etc links
// hosts and hostname to /run/cage, which is part of the sandbox's own root.
func writeIdentity(root string, spec *initSpec) error {
	dir := filepath.Join(root, "run", "cage")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	hosts := strings.Join([]string{
		"127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
		"127.0.1.1\t" + spec.Hostname, ""}, "\n")
	if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(hosts), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "hostname"), []byte(spec.Hostname+"\n"), 0o644)
}
