package daemon

import (
	"net"
	"strings"
	"testing"
)

// TestClusterConfig: the advertised address defaults to the API's own
// when it listens on one; listeners other nodes cannot reach at the
// advertised address, and bad values, stop the start with one line.
func TestClusterConfig(t *testing.T) {
	tcp := func(s string) net.Addr { a, _ := net.ResolveTCPAddr("tcp", s); return a }
	cc, err := Cluster{Kubeconfig: "k", NodeName: "n1"}.config(tcp("10.1.2.3:3000"), tcp("10.1.2.3:3001"))
	if err != nil || cc.Advertise != "10.1.2.3" || cc.APIPort != 3000 || cc.ProxyPort != 3001 || cc.Namespace != "cage" {
		t.Fatalf("config = %+v, %v", cc, err)
	}
	if _, err := (Cluster{Kubeconfig: "k", NodeName: "n1", Advertise: "10.9.9.9"}).config(tcp("0.0.0.0:3000"), tcp("0.0.0.0:3001")); err != nil {
		t.Fatalf("unspecified listeners: %v", err)
	}
	for name, c := range map[string]struct {
		cl         Cluster
		api, proxy string
		want       string
	}{
		"loopback api":   {Cluster{Kubeconfig: "k", NodeName: "n1", Advertise: "10.9.9.9"}, "127.0.0.1:3000", "0.0.0.0:3001", "--api listens on 127.0.0.1:3000"},
		"other proxy":    {Cluster{Kubeconfig: "k", NodeName: "n1"}, "10.1.2.3:3000", "10.1.2.4:3001", "--proxy listens on 10.1.2.4:3001"},
		"bad name":       {Cluster{Kubeconfig: "k", NodeName: "Node_1", Advertise: "10.9.9.9"}, "0.0.0.0:1", "0.0.0.0:2", "node name"},
		"negative lease": {Cluster{Kubeconfig: "k", NodeName: "n1", LeaseSeconds: -1}, "0.0.0.0:1", "0.0.0.0:2", "lease_seconds"},
		"short lease":    {Cluster{Kubeconfig: "k", NodeName: "n1", Advertise: "10.9.9.9", LeaseSeconds: 1}, "0.0.0.0:1", "0.0.0.0:2", "lease duration"},
		"overcommit":     {Cluster{Kubeconfig: "k", NodeName: "n1", Advertise: "10.9.9.9", CPUOvercommit: 0.5}, "0.0.0.0:1", "0.0.0.0:2", "overcommit"},
		"advertise":      {Cluster{Kubeconfig: "k", NodeName: "n1", Advertise: "somewhere"}, "0.0.0.0:1", "0.0.0.0:2", "advertise"},
	} {
		_, err := c.cl.config(tcp(c.api), tcp(c.proxy))
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want an error with %q", name, err, c.want)
		}
	}
}
