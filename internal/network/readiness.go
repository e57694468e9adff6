package network

import (
	"fmt"
	"os"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
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
	out = append(out, ruleFeatures())
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

// ruleFeatures says whether the kernel has what a sandbox's rules use
// beyond plain nf_tables: a connection count (nft_connlimit) and
// conntrack timeout policies (CONFIG_NF_CONNTRACK_TIMEOUT). One batch
// makes a table holding both and removes it again: the kernel checks each
// message and commits nothing that stays.
func ruleFeatures() Finding {
	const name = "connection bounds"
	c, err := nftables.New()
	if err != nil {
		return Finding{name, false, "netlink: " + err.Error()}
	}
	t := c.AddTable(&nftables.Table{Name: fmt.Sprintf("cage_probe_%d", os.Getpid()), Family: nftables.TableFamilyINet})
	c.AddObj(&nftables.NamedObj{Table: t, Name: "probe", Type: nftables.ObjTypeCtTimeout,
		Obj: &expr.CtTimeout{L3Proto: unix.NFPROTO_IPV4, L4Proto: unix.IPPROTO_TCP,
			Policy: expr.CtStatePolicyTimeout{expr.CtStateTCPCLOSE: closedTimeout}}})
	ch := c.AddChain(&nftables.Chain{Name: "probe", Table: t})
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		&expr.Connlimit{Count: maxFlows, Flags: expr.NFT_CONNLIMIT_F_INV}, &expr.Verdict{Kind: expr.VerdictDrop}}})
	c.DelTable(t)
	if err := c.Flush(); err != nil {
		return Finding{name, false, fmt.Sprintf("the kernel refused a connection count or a conntrack timeout policy (%v): "+
			"sandbox networks need nft_connlimit and CONFIG_NF_CONNTRACK_TIMEOUT; without them a networked sandbox does not start", err)}
	}
	return Finding{name, true, "nft_connlimit and conntrack timeout policies work"}
}
