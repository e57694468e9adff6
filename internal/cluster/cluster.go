// Package cluster makes cage hosts the nodes of a Kubernetes cluster
// (issue 21; docs/ARCHITECTURE.md, "Cluster mode"): a sandbox is a Pod in
// the cluster's namespace, placed by kube-scheduler, run by the node it is
// bound to through that host's walls, and its status reported back. This
// file holds the configuration and the client; schema.go the pod's shape;
// auth.go node-to-node authentication; node.go, pods.go and podstatus.go
// the node side; rbac.go the roles the nodes need. The front (front.go,
// route.go, keys.go, lifecycle.go: every node answering the whole E2B API
// for the cluster) builds on these.
package cluster

import (
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/cagehq/cage/internal/kube"
)

// Defaults of Config.
const (
	DefaultNamespace     = "cage"
	DefaultLeaseDuration = 40 * time.Second
	// A sandbox's cpus and memory are ceilings (cgroup limits), not
	// reservations, and most sandboxes idle: the Node offers its CPUs and
	// memory times these, so that kube-scheduler places about as many
	// sandboxes as one host takes (its pods capacity, max_sandboxes, is
	// the other bound).
	DefaultCPUOvercommit    = 32
	DefaultMemoryOvercommit = 16
	NodeLeaseNamespace      = "kube-node-lease"
)

// Config is a node's cluster configuration (cage serve --kubeconfig and
// the cluster.* keys of the config file).
type Config struct {
	Kubeconfig, Namespace, NodeName, Advertise string
	LeaseDuration                              time.Duration
	APIPort, ProxyPort                         int // where this node's API and proxy listen (for the Node's annotations)
	// CPUOvercommit and MemoryOvercommit multiply the host's CPUs and
	// memory into the Node's capacity (0: the defaults).
	CPUOvercommit, MemoryOvercommit float64
}

// Enabled reports whether c turns cluster mode on (a kubeconfig is named).
func (c *Config) Enabled() bool { return c != nil && c.Kubeconfig != "" }

// Defaults fills what c leaves out: the namespace, the node name (the
// host name), the advertised address (the first non-loopback IPv4
// address) and the lease duration.
func (c *Config) Defaults() error {
	if c.Namespace == "" {
		c.Namespace = DefaultNamespace
	}
	if c.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			return fmt.Errorf("cluster: node name: %w", err)
		}
		c.NodeName = h
	}
	if c.Advertise == "" {
		ip, err := firstIPv4()
		if err != nil {
			return err
		}
		c.Advertise = ip
	}
	if c.LeaseDuration == 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.CPUOvercommit == 0 {
		c.CPUOvercommit = DefaultCPUOvercommit
	}
	if c.MemoryOvercommit == 0 {
		c.MemoryOvercommit = DefaultMemoryOvercommit
	}
	return c.Validate()
}

// Validate refuses what cannot work, with a one-line error.
func (c *Config) Validate() error {
	if c.LeaseDuration < 2*time.Second {
		return fmt.Errorf("cluster: lease duration %v is under 2s", c.LeaseDuration)
	}
	if c.CPUOvercommit < 1 || c.CPUOvercommit > 1000 || c.MemoryOvercommit < 1 || c.MemoryOvercommit > 1000 {
		return fmt.Errorf("cluster: overcommit %v (cpu), %v (memory): each from 1 to 1000", c.CPUOvercommit, c.MemoryOvercommit)
	}
	if ip := net.ParseIP(c.Advertise); ip == nil || ip.IsUnspecified() {
		return fmt.Errorf("cluster: advertise %q is not an IP address other nodes can reach", c.Advertise)
	}
	if errs := validation.IsDNS1123Subdomain(c.NodeName); len(errs) > 0 {
		return fmt.Errorf("cluster: node name %q: %s", c.NodeName, errs[0])
	}
	if errs := validation.IsDNS1123Label(c.Namespace); len(errs) > 0 {
		return fmt.Errorf("cluster: namespace %q: %s", c.Namespace, errs[0])
	}
	return nil
}

// Client makes a client of the cluster's API server from c's kubeconfig.
func (c *Config) Client() (*kube.Client, error) {
	kc, err := kube.LoadKubeconfig(c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("cluster: kubeconfig %s: %w", c.Kubeconfig, err)
	}
	// QPS and burst: a node's own traffic (its pods' status, its lease).
	cl, err := kube.New(kc, kube.Options{UserAgent: "cage/" + c.NodeName, QPS: 200, Burst: 400})
	if err != nil {
		return nil, fmt.Errorf("cluster: kubeconfig %s: %w", c.Kubeconfig, err)
	}
	return cl, nil
}

func firstIPv4() (string, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "", fmt.Errorf("cluster: advertise: %w", err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			return n.IP.String(), nil
		}
	}
	return "", errors.New("cluster: advertise: this host has no non-loopback IPv4 address; set cluster.advertise")
}
