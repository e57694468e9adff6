package kubeplane

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Net is a cluster's network on one machine: a bridge in the caller's
// network namespace holding HostIP (10.197.N.1/24, the first N free here),
// and one named network namespace per node with a veth to the bridge
// (eth0, 10.197.N.11, .12, ...; lo up; default route via the bridge). Run
// the nodes' processes with `nsenter --net=NS(name)` (not `ip netns exec`,
// which mounts a fresh /sys that hides the cgroup hierarchies).
//
// Call it from a test binary that runs in a network namespace of its own
// (testutil.InOwnNetwork in TestMain), so the bridge goes with it.
type Net struct {
	HostIP net.IP
	Bridge string

	names map[string]string // node -> netns name
	ips   map[string]net.IP
	order []string
}

// Topology makes a Net for a test (root needed; it skips without, or fails
// where CAGE_REQUIRE_WALLS is set) and removes it in the test's cleanup.
func Topology(t testing.TB, names []string) *Net {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CAGE_REQUIRE_WALLS") != "" {
			t.Fatal("the cluster tests are required here (CAGE_REQUIRE_WALLS) but need root")
		}
		t.Skip("the cluster's network needs root")
	}
	n, err := NewNet(names)
	if err != nil {
		t.Fatalf("cluster network: %v", err)
	}
	t.Cleanup(n.Remove)
	return n
}

// NewNet makes a Net outside a test (cage bench); the caller must Remove it.
func NewNet(names []string) (n *Net, err error) {
	if len(names) == 0 || len(names) > 200 {
		return nil, fmt.Errorf("kubeplane: %d nodes (1 to 200)", len(names))
	}
	third, err := freeSubnet()
	if err != nil {
		return nil, err
	}
	id := randHex(3)
	n = &Net{HostIP: net.IPv4(10, 197, byte(third), 1), Bridge: "kpb" + id,
		names: map[string]string{}, ips: map[string]net.IP{}}
	defer func() {
		if err != nil {
			n.Remove()
		}
	}()
	host := fmt.Sprintf("%s/24", n.HostIP)
	if err := ipRun("link", "add", n.Bridge, "type", "bridge"); err != nil {
		return n, err
	}
	if err := ipRun("addr", "add", host, "dev", n.Bridge); err != nil {
		return n, err
	}
	if err := ipRun("link", "set", n.Bridge, "up"); err != nil {
		return n, err
	}
	for i, name := range names {
		if _, dup := n.names[name]; dup || name == "" || strings.ContainsAny(name, "/ \t\n") {
			return n, fmt.Errorf("kubeplane: bad or repeated node name %q", name)
		}
		ns := "cage-kp-" + id + "-" + name
		ip := net.IPv4(10, 197, byte(third), byte(11+i))
		n.names[name], n.ips[name] = ns, ip
		n.order = append(n.order, name)
		if err := addNode(n.Bridge, ns, fmt.Sprintf("kpv%s%d", id, i), ip, n.HostIP); err != nil {
			return n, fmt.Errorf("node %s: %w", name, err)
		}
	}
	return n, nil
}

// addNode makes the namespace ns and its veth (host side vethName on the
// bridge, eth0 inside with ip/24), lo up, default route via gw.
func addNode(bridge, ns, vethName string, ip, gw net.IP) error {
	steps := [][]string{
		{"netns", "add", ns},
		{"link", "add", vethName, "type", "veth", "peer", "name", "eth0", "netns", ns},
		{"link", "set", vethName, "master", bridge},
		{"link", "set", vethName, "up"},
		{"-n", ns, "addr", "add", ip.String() + "/24", "dev", "eth0"},
		{"-n", ns, "link", "set", "eth0", "up"},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "route", "add", "default", "via", gw.String()},
	}
	for _, s := range steps {
		if err := ipRun(s...); err != nil {
			return err
		}
	}
	return nil
}

// NS returns the path of name's network namespace (/run/netns/...).
func (n *Net) NS(name string) string { return "/run/netns/" + n.names[name] }

// IP returns name's address on the bridge.
func (n *Net) IP(name string) net.IP { return n.ips[name] }

// Names returns the node names in the order given.
func (n *Net) Names() []string { return append([]string(nil), n.order...) }

// Command returns a command that runs in name's network namespace only
// (nsenter --net), the rest of the caller's view (mounts, /sys) kept.
func (n *Net) Command(name, path string, args ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"--net=" + n.NS(name), "--", path}, args...)...)
}

// Remove deletes the namespaces (and with them the veths) and the bridge.
// Processes still running in a namespace keep it alive until they end.
func (n *Net) Remove() {
	for _, ns := range n.names {
		_ = ipRun("netns", "del", ns)
	}
	_ = ipRun("link", "del", n.Bridge)
}

// freeSubnet returns the first N for which no address here is in
// 10.197.N.0/24.
func freeSubnet() (int, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return 0, err
	}
	used := map[int]bool{}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			if v4 := ipn.IP.To4(); v4 != nil && v4[0] == 10 && v4[1] == 197 {
				used[int(v4[2])] = true
			}
		}
	}
	for i := 0; i < 256; i++ {
		if !used[i] {
			return i, nil
		}
	}
	return 0, fmt.Errorf("kubeplane: no free subnet in 10.197.0.0/16")
}

func ipRun(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
