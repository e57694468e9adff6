package conformance

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
)

// TestNetworkDenyName: in internet mode, `--deny other.example.org` keeps
// the sandbox from the name, not only from its DNS answer: the name does
// not resolve, and its address, written as an IP literal, is refused from
// the start; other hosts answer.
func TestNetworkDenyName(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		netHost(t)
		deny, err := network.ParseRule("other.example.org")
		if err != nil {
			t.Fatal(err)
		}
		b := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Internet, Deny: []network.Rule{deny}}})
		got := b.probeNet(t, fmt.Sprintf(`
get("ip_literal", "%s", 80)
resolve("name", "other.example.org")
get("other_host", "%s", 80)`, testutil.OtherHost, testutil.PublicHost))
		expectOutcomes(t, got, map[string]func(string) bool{
			"ip_literal": refused(), "name": notResolved(), "other_host": hasPrefix("OK:public"),
		}, map[string]string{
			"ip_literal": "the denied name's address is refused as an IP literal", "name": "the denied name does not resolve",
			"other_host": "a host nobody denied answers",
		})
	})
}

// heldConn is a python program: it connects to the sink at argv[1]:9000,
// sends "before ", says so in /tmp/connected, waits for /tmp/go, sends
// "after", ends its side and prints what the sink counted, or the error.
const heldConn = `import socket, os, sys, time
s = socket.create_connection((sys.argv[1], 9000), timeout=10)
s.sendall(b"before ")
open("/tmp/connected", "w").close()
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
try:
    s.sendall(b"after"); s.shutdown(socket.SHUT_WR)
    print("COUNT:" + s.recv(64).decode().strip())
except Exception as ex:
    print("CUT:" + type(ex).__name__)`

// TestNetworkPolicyChangeCutsConnection: a connection the sandbox opened
// under the internet is cut when the policy changes to one that refuses
// its destination, on every wall (the host's conntrack, not the wall,
// holds it).
func TestNetworkPolicyChangeCutsConnection(t *testing.T) {
	forEachWall(t, func(t *testing.T, w wall) {
		netHost(t)
		b := w.newBox(t, sandbox.Options{Net: network.Policy{Mode: network.Internet}})
		var wg sync.WaitGroup
		var held result
		wg.Go(func() {
			held = b.pyRunRaw(heldConn+"\n", func(o *agentclient.RunOptions) { o.Args = append(o.Args, testutil.PublicHost.String()) })
		})
		defer wg.Wait()
		deadline := time.Now().Add(30 * time.Second)
		for b.sh("test -e /tmp/connected").code() != 0 {
			if time.Now().After(deadline) {
				b.sh("touch /tmp/go")
				t.Fatal("the sandbox never connected to the sink")
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err := b.sb.Network().SetPolicy(policy(t, network.Allowlist, testutil.OtherHost.String())); err != nil {
			t.Fatal(err)
		}
		b.sh("touch /tmp/go")
		wg.Wait()
		if out := strings.TrimSpace(held.stdout); strings.HasPrefix(out, "COUNT:") {
			t.Errorf("the connection outlived a policy that refuses it: %q", out)
		} else if !strings.HasPrefix(out, "CUT:") {
			t.Errorf("held connection: %q %q %v", out, clip(held.stderr), held.err)
		}
	})
}
