package inside

import (
	"os"
	"path/filepath"
	"strings"
)

// Accounts of every sandbox: root, the default user (uid 1000), the agent's
// own account, and nobody.
const (
	UserName  = "user"
	UserUID   = 1000
	AgentName = "cage-agent"
	AgentUID  = 65533
)

// NoNetworkResolvConf is the resolv.conf of a sandbox without a network.
const NoNetworkResolvConf = "# cage: this sandbox has no network\n"

// HostsFile is a sandbox's /etc/hosts: localhost and its own name.
func HostsFile(hostname string) string {
	return strings.Join([]string{"127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
		"127.0.1.1\t" + hostname, ""}, "\n")
}

// WriteIdentity writes the files that name one sandbox, hosts and hostname,
// and its resolv.conf into dir, which the sandbox sees as /run/cage (its
// /etc links there).
func WriteIdentity(dir, hostname, resolvConf string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(HostsFile(hostname)), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "resolv.conf"), []byte(resolvConf), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "hostname"), []byte(hostname+"\n"), 0o644)
}
