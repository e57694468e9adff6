package process

import (
	"path/filepath"

	"github.com/cagehq/cage/internal/template"
)

// Child side: the files that name this sandbox. The template's /etc links
// hosts and hostname to /run/cage, which is part of the sandbox's own root.
func writeIdentity(root string, spec *initSpec) error {
	return template.WriteIdentity(filepath.Join(root, "run", "cage"), spec.Hostname)
}
