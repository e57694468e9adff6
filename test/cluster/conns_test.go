package cluster

import (
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/cagehq/cage/test/cluster/clusterutil"
)

// Attack (a tenant of a cluster): hold requests open through front A to
// its own sandbox on node C. A opens one connection to C per request in
// flight, all from A's one address, which C's listener held to
// conns_per_client: with those taken, every other forward of A's to C,
// another tenant's included, failed with 502 until the tenant let go.
// Expected (C's conns_per_client scaled down to 8): with 8 of the
// tenant's requests held open through A, another tenant's request for its
// sandbox on C through A is answered (200): C holds its peers to the
// bound on all connections only.
func TestClusterForwardsShareNoClientBound(t *testing.T) {
	c := clusterutil.Start(t, clusterutil.Options{Nodes: []clusterutil.NodeOptions{
		{Name: "a", Walls: []string{"process"}},
		{Name: "c", Walls: []string{"process"}, Config: map[string]any{"limits": map[string]any{"conns_per_client": 8}}}}})
	defer func() {
		if t.Failed() {
			for _, n := range c.Nodes {
				t.Logf("=== node %s's log:\n%s", n.Name, tail(n.Log(), 40))
			}
		}
	}()
	where := watchPlacements(t, c)
	mine := onNode(t, c, where, "c", 1)[0]
	defer kill(t, c, "a", mine)
	other := c.NewKey(t, "other-tenant")
	// Its sandboxes elsewhere are kept until one lands on C (the
	// scheduler prefers the emptiest node).
	var theirs string
	var elsewhere []string
	for i := 0; i < 8 && theirs == ""; i++ {
		code, out := call(t, c, "a", "POST", "/sandboxes", other, `{"templateID":"host","timeout":300}`)
		id := jsonField(out, "sandboxID")
		if code != 201 || id == "" {
			t.Fatalf("the other tenant's create: %d %s", code, out)
		}
		if where.node(id) == "c" {
			theirs = id
		} else {
			elsewhere = append(elsewhere, id)
		}
	}
	for _, id := range elsewhere {
		call(t, c, "a", "DELETE", "/sandboxes/"+id, other, "")
	}
	if theirs == "" {
		t.Fatal("none of the other tenant's sandboxes landed on c")
	}
	defer call(t, c, "a", "DELETE", "/sandboxes/"+theirs, other, "")

	// Eight requests whose bodies never come, forwarded to C and held there.
	u, _ := url.Parse(c.Nodes["a"].API)
	for i := 0; i < 8; i++ {
		conn, err := net.Dial("tcp", u.Host)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST /sandboxes/%s/timeout HTTP/1.1\r\nHost: %s\r\nX-API-Key: %s\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{", mine, u.Host, c.Key)
	}
	time.Sleep(2 * time.Second) // forwarded, each holding a connection to C
	if code, out := call(t, c, "a", "GET", "/sandboxes/"+theirs, other, ""); code != 200 {
		t.Errorf("another tenant's request through A while one holds %d to C: %d %s; want 200", 8, code, out)
	}
}

// jsonField is the string field name of a JSON object ("" where none).
func jsonField(body, name string) string {
	var m map[string]any
	_ = json.Unmarshal([]byte(body), &m)
	s, _ := m[name].(string)
	return s
}
