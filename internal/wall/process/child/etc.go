package child

import (
	"path/filepath"

	"github.com/cagehq/cage/internal/inside"
)

// Child side: the files that name this sandbox. The template's /etc links
// hosts, hostname and resolv.conf to /run/cage, which is part of the
// sandbox's own root. A sandbox is built without a network; Start rewrites
// resolv.conf when it gets one (see Child.WaitStart).
func writeIdentity(root string, spec *InitSpec) error {
	return inside.WriteIdentity(filepath.Join(root, "run", "cage"), spec.Hostname, inside.NoNetworkResolvConf)
}
