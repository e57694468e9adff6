package network

import (
	"fmt"
	"os"
	"strings"

	"github.com/google/nftables"
)

// Finding is one fact about the host's readiness for sandbox networks.
type Finding struct {
	Name string
	OK   bool
	Info string
}

// Readiness reports, without changing anything on the host, whether
// sandbox networks can work here: nftables over netlink, IPv4 forwarding,
// veth, and the resolvers allowed names are forwarded to (upstreams as
// configured; the host's /etc/resolv.conf when empty).
func Readiness(upstreams []string) []Finding {
	var out []Finding
	if conn, err := nftables.New(); err != nil {
		out = append(out, Finding{"nftables", false, "netlink: " + err.Error()})
	} else if tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet); err != nil {
		out = append(out, Finding{"nftables", false, fmt.Sprintf("cannot list tables over netlink (%v): the kernel needs nf_tables", err)})
	} else {
		info := "netlink works; no cage table yet (made by the first networked sandbox)"
		for _, t := range tables {
			if t.Name == tableName {
				n, _ := TableSlots()
				info = fmt.Sprintf("netlink works; table inet %s holds %d sandbox(es)", tableName, len(n))
			}
		}
		out = append(out, Finding{"nftables", true, info})
	}
	out = append(out, forwarding())
	if _, err := os.Stat("/sys/module/veth"); err != nil {
		if _, err := os.Stat("/sys/class/net"); err != nil {
			out = append(out, Finding{"veth", false, "no /sys/class/net: is sysfs mounted?"})
		} else {
			out = append(out, Finding{"veth", true, "module not loaded yet (loaded on first use; built in on some kernels)"})
		}
	} else {
		out = append(out, Finding{"veth", true, "loaded"})
	}
	src := "configured"
	if len(upstreams) == 0 {
		upstreams, src = HostResolvers("/etc/resolv.conf"), "from /etc/resolv.conf"
	}
	if len(upstreams) == 0 {
		out = append(out, Finding{"dns upstreams", false, "none: /etc/resolv.conf names no nameserver; set network.dns in the config or CAGE_DNS"})
	} else {
		out = append(out, Finding{"dns upstreams", true, strings.Join(upstreams, ", ") + " (" + src + ")"})
	}
	return out
}

// forwarding says whether the host forwards IPv4, and who decided.
func forwarding() Finding {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	if err != nil {
		return Finding{"ip forwarding", false, err.Error()}
	}
	if strings.TrimSpace(string(b)) != "1" {
		return Finding{"ip forwarding", true, "off; cage turns it on when the first networked sandbox starts, and then drops forwarded traffic that is not a sandbox's (the host routes nothing else)"}
	}
	guarded := false
	if n, err := newNFT(); err == nil {
		guarded = n.forwardGuarded()
		n.close()
	}
	if guarded {
		return Finding{"ip forwarding", true, "on, turned on by cage, which drops forwarded traffic that is not a sandbox's; " +
			"for the host to route for something else too (Docker, libvirt started later): nft flush chain inet cage guard"}
	}
	return Finding{"ip forwarding", true, "on, and it was on before cage: the host routes between its interfaces as its own firewall says; cage's rules govern only what sandboxes send"}
}
