package process

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Child side: the /etc files that belong to the sandbox rather than the host:
// accounts, host name, hosts and resolver. Host files named by the template
// are already bound read-only.
func writeEtc(root string, spec *initSpec) error {
	etc := filepath.Join(root, "etc")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		return err
	}
	files := map[string]string{
		"passwd": fmt.Sprintf("root:x:0:0:root:/root:/bin/bash\n%s:x:%d:%d:%s:/home/%s:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
			spec.UserName, spec.UserUID, spec.UserGID, spec.UserName, spec.UserName),
		"group":    fmt.Sprintf("root:x:0:\ntty:x:5:\n%s:x:%d:\nnogroup:x:65534:\n", spec.UserName, spec.UserGID),
		"shadow":   "",
		"hostname": spec.Hostname + "\n",
		"hosts": strings.Join([]string{
			"127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
			"127.0.1.1\t" + spec.Hostname, ""}, "\n"),
		"resolv.conf": "# cage: this sandbox has no network\n",
		"mtab":        "",
	}
	for name, content := range files {
		mode := os.FileMode(0o644)
		if name == "shadow" {
			mode = 0o600
		}
		if name == "mtab" {
			if err := os.Symlink("/proc/self/mounts", filepath.Join(etc, name)); err != nil {
				return err
			}
			continue
		}
		if err := os.WriteFile(filepath.Join(etc, name), []byte(content), mode); err != nil {
			return err
		}
	}
	return nil
}
